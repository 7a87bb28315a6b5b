"""The command-line tools, run by ``python -m fusedopt {check,demo,bench}``
(:mod:`fusedopt.__main__`):

* :mod:`.check`: the self-check (every backend on every device against the float64 reference);
* :mod:`.bench`: the step-time benchmark (also ``python -m fusedopt.tools.bench``);
* :mod:`.demo`: the large-batch demo (small vs large batch on scikit-learn's digits);
* :mod:`.sweep`: the batch-size sweep (``fusedopt demo sweep``);
* :mod:`.digits`: the training problem the demo and the sweep share (data, model, optimizers,
  noise-scale probes);
* :mod:`.common`: the user-facing error, the checks of options and ``--set`` values, CLI helpers.

Nothing here is imported by ``import fusedopt``.
"""
