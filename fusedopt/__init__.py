"""fusedopt: fused LAMB and LARS optimizers for large-batch training."""
from .backends import available_backends
from .flat import FlatParameters, flatten_parameters
from .groups import name_patterns, one_dimensional, param_groups
from .noise_scale import DDPGradientNoiseScale, GradientAccumulationNoiseScale, GradientNoiseScale
from .optim import FusedLAMB, FusedLARS

__all__ = [
    "FusedLAMB",
    "FusedLARS",
    "GradientNoiseScale",
    "GradientAccumulationNoiseScale",
    "DDPGradientNoiseScale",
    "available_backends",
    "FlatParameters",
    "flatten_parameters",
    "name_patterns",
    "one_dimensional",
    "param_groups",
]
__version__ = "0.1.0"
