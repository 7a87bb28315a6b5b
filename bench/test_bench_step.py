"""pytest-benchmark flavour of ``python -m fusedopt.tools.bench`` (not part of the test suite).

    python -m pytest bench/ --benchmark-columns=median,iqr,rounds

Each benchmark's ``extra_info`` records the bytes model and the element count, so GB/s can be
derived from the saved JSON (``--benchmark-json``).
"""
import pytest
import torch

import fusedopt
from fusedopt.tools.bench import BYTES_PER_ELEMENT, bert_base_shapes, make_params

SETS = {"bert2": bert_base_shapes(layers=2, vocab=4000), "small500": [(2500,)] * 500}
OPTS = {
    "lamb": lambda ps, be: fusedopt.FusedLAMB(ps, backend=be),
    "lars": lambda ps, be: fusedopt.FusedLARS(ps, lr=0.1, weight_decay=1e-4, backend=be),
}
BACKENDS = [b for b in fusedopt.available_backends() if b in ("eager", "cpp")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", list(OPTS))
@pytest.mark.parametrize("set_name", list(SETS))
def test_step(benchmark, set_name, kind, backend):
    ps = make_params(SETS[set_name], torch.device("cpu"))
    opt = OPTS[kind](ps, backend)
    benchmark.extra_info.update(bytes_per_element=BYTES_PER_ELEMENT[kind],
                                numel=sum(p.numel() for p in ps))
    benchmark(opt.step)


@pytest.mark.parametrize("set_name", list(SETS))
def test_torch_adamw_fused(benchmark, set_name):
    ps = make_params(SETS[set_name], torch.device("cpu"))
    opt = torch.optim.AdamW(ps, fused=True)
    benchmark.extra_info.update(bytes_per_element=BYTES_PER_ELEMENT["adamw"],
                                numel=sum(p.numel() for p in ps))
    benchmark(opt.step)
