"""Records tests/data/lowp_v1.pt: 8-bit state dicts of fusedopt's earlier 8-bit format, for
tests/test_low_precision.py (test_8bit_checkpoints_of_the_earlier_format_load_converted).

Run with a checkout of the commit before the format changed (d3f344a) first on the path, its
extension built in place (tests/data/README.md)::

    PYTHONPATH=OLD .venv/bin/python tests/data/make_lowp_v1.py tests/data/lowp_v1.pt OLD
"""
import copy
import sys

import torch

import fusedopt
from fusedopt import lowp

out_path, source = sys.argv[1], sys.argv[2]
assert fusedopt.__file__.startswith(source), fusedopt.__file__  # the earlier version itself
shapes = ((8, 512), (700,), (3, 100))
record = {}
for kind in ("lamb", "lars"):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    kw = dict(backend="cpp", state_precision="8bit", state_min_numel=0)
    opt = (fusedopt.FusedLAMB(params, lr=1e-2, **kw) if kind == "lamb"
           else fusedopt.FusedLARS(params, lr=0.1, weight_decay=1e-4, **kw))
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    sd = copy.deepcopy(opt.state_dict())  # its codes were views of the state, its scales copies
    values = []
    for p in params:
        st, vals = opt.state[p], {}
        for key in opt._state_keys:
            x = lowp.read(st[key], p.shape, root=key == "exp_avg_sq")
            vals[key] = (x * x if key == "exp_avg_sq" else x).clone()
        values.append(vals)
    start = [p.detach().clone() for p in params]
    grads = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(2)]
    for g in grads:
        for p, x in zip(params, g):
            p.grad = x.clone()
        opt.step()
    record[kind] = dict(state_dict=sd, values=values, params=start, grads=grads,
                        params_after=[p.detach().clone() for p in params])
torch.save(record, out_path)
