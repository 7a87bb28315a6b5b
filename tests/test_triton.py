"""The Triton backend against the float64 reference, its launch count, tables and availability.

On a machine without CUDA the kernels run in Triton's interpreter on CPU tensors: that needs
TRITON_INTERPRET=1 before triton is first imported, so it is set here, before anything imports
triton (importing fusedopt does not; see Note [lazy import] in fusedopt/backends/triton_backend.py).
On a CUDA machine the same tests run the compiled kernels on the GPU.
The interpreter costs about a millisecond per operation of a program, so the tests shrink the
chunk layout (``small_tiles``) and use small shapes and few steps.
"""
import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from fusedopt.backends import triton_backend  # noqa: E402
from fusedopt.backends.triton_backend import TritonBackend  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
if INTERPRETED and triton_backend.interpreter_reason() is not None:
    pytest.skip(triton_backend.interpreter_reason(), allow_module_level=True)

from fusedopt.kernels import tables  # noqa: E402
from helpers import (  # noqa: E402
    LAMB_CASES, LARS_CASES, SHAPES_SMALL, assert_within_rounding, max_rel_err, run_backend, tols,
)

import fusedopt  # noqa: E402

# The interpreter evaluates masked-off lanes too (0/0 of a zero-size tensor's trust ratio).
pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|divide by zero):RuntimeWarning")

TINY = [(1 + i % 5,) for i in range(300)]


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Chunks of 2048 elements, 64 per program, tiles of 64 x 512: a 4097-element tensor spans
    three chunks (multi-chunk norms) and four tiles per chunk, with a program for all of it."""
    monkeypatch.setattr(tables, "CHUNK_SIZE", 2048)
    monkeypatch.setattr(tables, "ROWS", 64)
    monkeypatch.setattr(tables, "BLOCK_SIZE", 512)


def _run(kind, hyper, **kw):
    kw.setdefault("steps", 3)
    return run_backend(kind, "triton", kw.pop("shapes", SHAPES_SMALL), hyper, device=DEVICE, **kw)


# ------------------------------------------------------------------------- float32 parity
@pytest.mark.parametrize("case", list(LAMB_CASES))
def test_lamb_matches_reference(case):
    params, ref, _ = _run("lamb", LAMB_CASES[case], zero_weight=1, zero_grad=2, excluded=(3,))
    assert max_rel_err(params, ref) <= tols(torch.float32)


@pytest.mark.parametrize("case", list(LARS_CASES))
def test_lars_matches_reference(case):
    params, ref, _ = _run("lars", LARS_CASES[case], zero_weight=1, zero_grad=2, excluded=(3,))
    assert max_rel_err(params, ref) <= tols(torch.float32)


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_float64_matches_reference(kind):
    hyper = {} if kind == "lamb" else LARS_CASES["torch_sgd_dampening"]
    params, ref, _ = _run(kind, hyper, dtype=torch.float64)
    assert max_rel_err(params, ref) <= tols(torch.float64)


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_hundreds_of_tiny_tensors(kind):
    hyper = dict(max_grad_norm=1.0) if kind == "lamb" else LARS_CASES["default"]
    params, ref, _ = _run(kind, hyper, shapes=TINY + [(4097,), (0,)], steps=2)
    assert max_rel_err(params, ref) <= tols(torch.float32)


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_full_programs_take_the_unmasked_path(kind, monkeypatch):
    """Two rows per program and tensors of whole chunks: every program runs unmasked tiles."""
    monkeypatch.setattr(tables, "ROWS", 2)
    params, ref, _ = _run(kind, {} if kind == "lamb" else LARS_CASES["default"],
                          shapes=[(4, 1024), (2048,), (3, 2048)])
    assert max_rel_err(params, ref) <= tols(torch.float32)


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_learning_rate_tensor(kind):
    hyper = {} if kind == "lamb" else LARS_CASES["default"]
    lr = {"lamb": 1e-2, "lars": 0.5}[kind]
    params, ref, _ = _run(kind, hyper, lr=torch.tensor(lr), steps=2)
    assert max_rel_err(params, ref) <= tols(torch.float32)


# --------------------------------------------------------------- low-precision storage
@pytest.mark.parametrize("master", [True, False], ids=["master", "no_master"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_low_precision_within_rounding(kind, dtype, master):
    hyper = {} if kind == "lamb" else LARS_CASES["default"]
    fast, ref, opt = _run(kind, hyper, dtype=dtype, master_weights=master)
    slow, _, _ = run_backend(kind, "eager", SHAPES_SMALL, hyper, dtype=dtype, master_weights=master,
                             steps=3, device=DEVICE)
    assert_within_rounding(fast, slow, ref, atol=1e-6)
    if master:
        for p in fast:
            assert torch.equal(opt.state[p]["master_param"].to(dtype), p.detach())


def test_bf16_grads_with_fp32_params():
    fast, ref, _ = _run("lamb", {}, grad_dtype=torch.bfloat16)
    slow, _, _ = run_backend("lamb", "eager", SHAPES_SMALL, {}, grad_dtype=torch.bfloat16, steps=3,
                             device=DEVICE)
    assert max_rel_err(fast, ref) <= tols(torch.float32)
    assert max(max_rel_err([f], [s.detach().double().cpu()]) for f, s in zip(fast, slow)) <= 1e-6


# ------------------------------------------------------------- GradScaler protocol
def _scaled_pair(kind, hyper, scale, found):
    """The same scaled gradients stepped by triton and eager with grad_scale/found_inf set."""
    out = []
    for backend in ("triton", "eager"):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(DEVICE)) for s in SHAPES_SMALL]
        cls = fusedopt.FusedLAMB if kind == "lamb" else fusedopt.FusedLARS
        opt = cls(params, lr=0.1, backend=backend, **hyper)
        for f in found:
            for p in params:
                p.grad = (torch.randn(p.shape, generator=gen) * scale).to(DEVICE)
            opt.grad_scale = torch.tensor(scale, device=DEVICE)
            opt.found_inf = torch.tensor(f, device=DEVICE)
            opt.step()
        out.append((params, opt))
    return out


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_grad_scale_and_clipping_match_eager(kind):
    hyper = dict(max_grad_norm=0.5) if kind == "lamb" else dict(max_grad_norm=0.5, weight_decay=1e-4)
    (fast, _), (slow, _) = _scaled_pair(kind, hyper, 1024.0, [0.0, 0.0])
    assert max_rel_err(fast, [s.detach().double().cpu() for s in slow]) <= 1e-6


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_found_inf_makes_the_step_a_no_op(kind):
    (fast, opt), _ = _scaled_pair(kind, {}, 8.0, [0.0])
    before = {k: v.clone() for p in fast for k, v in opt.state[p].items()}
    weights = [p.detach().clone() for p in fast]
    for p in fast:
        p.grad = torch.full_like(p, float("inf"))
    opt.found_inf = torch.tensor(1.0, device=DEVICE)
    opt.step()
    after = {k: v for p in fast for k, v in opt.state[p].items()}
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(w, p.detach()) for w, p in zip(weights, fast))
    assert all(opt.state[p]["step"].item() == 1.0 for p in fast)


# ------------------------------------------------------------------ launches and tables
def _launches_per_step(kind, n_tensors, hyper):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, generator=gen).to(DEVICE)) for _ in range(n_tensors)]
    cls = fusedopt.FusedLAMB if kind == "lamb" else fusedopt.FusedLARS
    opt = cls(params, lr=0.1, backend="triton", **hyper)
    counts = []
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(3, generator=gen).to(DEVICE)
        before = tables.launch_count()
        opt.step()
        counts.append(tables.launch_count() - before)
    assert counts[0] == counts[1]
    return counts[0]


@pytest.mark.parametrize("clip", [None, 1.0], ids=["no_clip", "clip"])
@pytest.mark.parametrize("kind,limit", [("lamb", 3), ("lars", 2)])
def test_launches_per_step_do_not_grow_with_tensors(kind, limit, clip):
    few = _launches_per_step(kind, 3, dict(max_grad_norm=clip))
    many = _launches_per_step(kind, 300, dict(max_grad_norm=clip))
    assert few == many <= limit + (clip is not None)


def test_split_beyond_the_tensor_limit(monkeypatch):
    monkeypatch.setattr(tables, "MAX_TENSORS_PER_LAUNCH", 4)
    assert _launches_per_step("lars", 10, {}) == 2 * 3  # slices of 4, 4 and 2 tensors
    params, ref, _ = _run("lamb", dict(max_grad_norm=1.0), shapes=SHAPES_SMALL * 2, steps=2)
    assert max_rel_err(params, ref) <= tols(torch.float32)


def test_tables_are_cached_while_pointers_stay():
    tables.clear_cache()
    _, _, opt = _run("lars", {}, steps=1)
    size = len(tables._cache)
    params = [p for g in opt.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.randn_like(p)  # new grad tensors: new pointers, new tables
    opt.step()
    grown = len(tables._cache)
    assert grown > size
    for p in params:
        p.grad.normal_()  # same tensors: the tables are reused
    opt.step()
    assert len(tables._cache) == grown


def test_norms_are_deterministic_and_independent_of_rows(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(s, generator=gen).to(DEVICE) for s in [(4097,), (3, 5), (0,), (7000,)]]
    be = TritonBackend()
    first = be.sq_norms(xs)
    monkeypatch.setattr(tables, "ROWS", 1)
    assert torch.equal(be.sq_norms(xs), first)
    expect = torch.stack([(x.double() ** 2).sum() for x in xs]).float()
    torch.testing.assert_close(first, expect, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_sq_norms(dtype):
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(s, generator=gen).to(DEVICE, dtype) for s in [(4097,), (1,), (0,)]]
    xs.append(torch.randn(6, 4, generator=gen).to(DEVICE, dtype).t())  # dense, not contiguous
    xs.append(torch.randn(6, 4, generator=gen).to(DEVICE, dtype)[:, ::2])  # not dense: copied
    out = TritonBackend().sq_norms(xs)
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    expect = torch.stack([(x.double() ** 2).sum() for x in xs]).to(out.dtype)
    torch.testing.assert_close(out, expect, rtol=1e-6 if dtype != torch.float64 else 1e-12, atol=0)


# -------------------------------------------------------------------------- availability
def test_unavailable_reasons(monkeypatch):
    be = TritonBackend()
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert "int32" in be.unavailable_reason(cpu, torch.int32, torch.float32)
    assert be.unavailable_reason(torch.device("meta"), torch.float32, torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "CUDA memory" in be.unavailable_reason(cuda, torch.float32, torch.float32)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert be.unavailable_reason(cuda, torch.float32, torch.float32) is None
    reason = be.unavailable_reason(cpu, torch.float32, torch.float32)
    assert "TRITON_INTERPRET=1" in reason and "CUDA" in reason
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        p = torch.nn.Parameter(torch.ones(2))
        p.grad = torch.ones(2)
        fusedopt.FusedLAMB([p], backend="triton").step()


def test_missing_triton_raises_import_error(monkeypatch):
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ImportError, match="pip install triton"):
        TritonBackend()


def test_importing_fusedopt_does_not_import_triton():
    code = ("import sys, fusedopt; fusedopt.available_backends(); "
            "assert 'triton' not in sys.modules, 'triton imported'")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env,
                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
