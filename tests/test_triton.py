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
    LAMB_CASES, LARS_CASES, SHAPES_SMALL, assert_nan_rule, assert_within_rounding, max_rel_err,
    nan_rule_runs, run_backend, tols,
)

import fusedopt  # noqa: E402

# The interpreter evaluates masked-off lanes too (0/0 of a zero-size tensor's trust ratio).
pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|divide by zero):RuntimeWarning")

TINY = [(1 + i % 5,) for i in range(300)]


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Under the interpreter: chunks of 2048 elements, 64 per program, tiles of 64 x 512 (a
    4097-element tensor spans three chunks and four tiles per chunk, with a program for all of
    it). On a GPU the tests run the GPU tile defaults: compiled, the interpreter's wide tiles
    spill and take minutes per kernel to build."""
    if INTERPRETED:
        for name, value in tables.INTERPRETER_TILES.items():
            monkeypatch.setattr(tables, name, value)


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
    before = {(i, k): v.clone() for i, p in enumerate(fast) for k, v in opt.state[p].items()}
    weights = [p.detach().clone() for p in fast]
    for p in fast:
        p.grad = torch.full_like(p, float("inf"))
    opt.found_inf = torch.tensor(1.0, device=DEVICE)
    opt.step()
    after = {(i, k): v for i, p in enumerate(fast) for k, v in opt.state[p].items()}
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


def _groups_opt(kind, n_groups, **hyper):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, generator=gen).to(DEVICE)) for _ in range(2 * n_groups)]
    groups = [{"params": params[2 * i:2 * i + 2], "lr": 0.01 * (i + 1)} for i in range(n_groups)]
    cls = fusedopt.FusedLAMB if kind == "lamb" else fusedopt.FusedLARS
    return params, cls(groups, lr=0.1, backend="triton", **hyper)


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_no_table_is_built_after_the_first_step(kind):
    """40 groups with clipping (two tables per bucket: the passes and the grads' norms): after
    the first step, steps with the same tensors build nothing (Note [table ownership])."""
    params, opt = _groups_opt(kind, 40, max_grad_norm=1.0)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    before = tables.build_count()
    for _ in range(3):
        for p in params:
            p.grad.normal_()  # same grad tensors: same pointers
        opt.step()
    assert tables.build_count() == before
    for p in params[:2]:
        p.grad = torch.randn_like(p)  # new grads in the first group: its two tables are rebuilt
    opt.step()
    assert tables.build_count() == before + 2


def test_a_compiled_step_builds_its_tables_once():
    """The same with ``torch.compile(opt.step)``: the operators find each bucket's tables in the
    optimizer's step cache (Note [triton operators]), so 40 groups with clipping build their
    tables at the first compiled step only (before, the operators' own cache of 64 entries
    held 32 groups' tables and rebuilt all of them at every step)."""
    params, opt = _groups_opt("lamb", 40, max_grad_norm=1.0)
    for p in params:
        p.grad = torch.randn_like(p)
    torch._dynamo.reset()
    step = torch.compile(opt.step)
    step()
    before = tables.build_count()
    for _ in range(2):
        for p in params:
            p.grad.normal_()
        step()
    assert tables.build_count() == before
    assert all(float(opt.state[p]["step"]) == 3 for p in params)


def test_table_upload_never_blocks_the_host(monkeypatch):
    """A table goes to a CUDA device from pinned memory with a non-blocking copy (mocked here:
    the copy is the only CUDA call of a build)."""
    calls = []

    def fake_pin(self):
        calls.append("pin")
        return self

    def fake_to(self, *args, **kwargs):
        calls.append(("to", str(args[0]), kwargs.get("non_blocking", False)))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    monkeypatch.setattr(torch.Tensor, "to", fake_to)
    device, pinned = tables._upload(torch.zeros(4, dtype=torch.int64), torch.device("cuda", 1))
    assert calls == ["pin", ("to", "cuda:1", True)]
    assert pinned is not None  # kept alive with the table until the copy has run


def test_launch_runs_under_the_tables_device(monkeypatch):
    """Note [device guard]: each launch runs with its table's device current (so Triton picks
    that device's current stream); mocked here, as no CUDA device exists."""
    current = ["cuda:0"]
    seen = []

    class Guard:
        def __init__(self, device):
            self.device = torch.device(device)

        def __enter__(self):
            self.saved, current[0] = current[0], str(self.device)

        def __exit__(self, *exc):
            current[0] = self.saved

    class Kernel:
        def __getitem__(self, grid):
            return lambda **kw: seen.append((current[0], grid, "stream" in kw))

    monkeypatch.setattr(torch.cuda, "device", Guard)
    table = tables.Table(device=torch.device("cuda", 1), n=1, num_chunks=1, num_programs=3,
                         records=None, owner=None, counters=None, aligned=True)
    tables.launch(Kernel(), table, CHUNK=4)
    assert seen == [("cuda:1", (3,), False)]
    assert current == ["cuda:0"]


def test_failed_launch_names_the_kernel_and_resets_the_counters():
    be = TritonBackend()
    x = [torch.ones(5, device=DEVICE)]
    table = tables.tables([x])[0]
    table.counters.fill_(7)  # as a launch that stopped half-way could leave them

    def sq_norms_kernel():
        pass

    class Broken:  # a JITFunction's shape: .fn, and [grid](**kwargs) launches
        fn = staticmethod(sq_norms_kernel)

        def __getitem__(self, grid):
            def run(**kw):
                raise ValueError("boom")
            return run

    with pytest.raises(tables.KernelError, match=r"sq_norms_kernel.*ALIGNED=True.*boom"):
        tables.launch(Broken(), table, ALIGNED=True, CHUNK=2048)
    assert int(table.counters.abs().sum()) == 0
    assert torch.equal(be.sq_norms(x), torch.tensor([5.0], device=DEVICE))


def test_capture_never_builds_a_table(monkeypatch):
    """During CUDA-graph capture a table or constant operand that would have to be made raises
    (its buffers must exist before the capture); those that exist are used as they are."""
    store = tables.TableStore()
    xs = [torch.ones(3, device=DEVICE)]
    built = tables.tables([xs], store)
    monkeypatch.setattr(tables, "capturing", lambda device: True)
    assert tables.tables([xs], store) is built
    with pytest.raises(RuntimeError, match="CUDA graph capture"):
        tables.tables([[torch.ones(4, device=DEVICE)]], store)
    # Note [runtime flags]: the constant operands are made before capture as well
    monkeypatch.setattr(tables, "capturing", lambda device: False)
    one = tables.operand(torch.device(DEVICE), torch.float32, 1.0)
    monkeypatch.setattr(tables, "capturing", lambda device: True)
    assert tables.operand(torch.device(DEVICE), torch.float32, 1.0) is one
    with pytest.raises(RuntimeError, match="CUDA graph capture"):
        tables.operand(torch.device(DEVICE), torch.float32, 0.5)


def test_alignment_is_decided_per_tensor(monkeypatch):
    """Note [per-tensor alignment]: a misaligned neighbour gets its own launch; the aligned
    tensors keep the vector path and their sums stay bit-identical."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(s, generator=gen).to(DEVICE) for s in [(4097,), (33,), (2048,)]]
    odd = torch.randn(101, generator=gen).to(DEVICE)[1:]  # 4 bytes past a 16-byte boundary
    assert odd.data_ptr() % 16 != 0 and all(x.data_ptr() % 16 == 0 for x in xs)
    flags = []
    real = tables.launch

    def spy(kernel, table, **kw):
        flags.append((table.n, kw["ALIGNED"]))
        real(kernel, table, **kw)

    monkeypatch.setattr(tables, "launch", spy)
    be = TritonBackend()
    alone = be.sq_norms(xs)
    assert flags == [(3, True)]
    flags.clear()
    mixed = be.sq_norms([xs[0], odd, xs[1], xs[2]])
    assert sorted(flags) == [(1, False), (3, True)]
    assert torch.equal(mixed[[0, 2, 3]], alone)
    torch.testing.assert_close(mixed[1], (odd.double() ** 2).sum().float(), rtol=1e-6, atol=0)


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


# ------------------------------------------------------------------------------ NaN rule
def test_nan_norms_give_nan_trust_ratios():
    """Note [NaN propagation]: as on eager and cpp (tests/test_nan_rule.py). The interpreter's
    tl.maximum keeps NaN where the compiled one does not, so the kernels' clamps are also checked
    compiled (tests/test_triton_compile.py)."""
    assert_nan_rule(nan_rule_runs("triton", DEVICE))


# ------------------------------------------------------------------ compile failures
def _lamb_opt(backend):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(DEVICE)) for s in SHAPES_SMALL]
    return params, fusedopt.FusedLAMB(params, lr=0.01, backend=backend, max_grad_norm=1.0)


def _set_grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(DEVICE)


@pytest.fixture
def broken_pass2(monkeypatch):
    """lamb_pass2_kernel fails to compile (as a ptxas error would), for every specialization."""
    from fusedopt import backends
    from fusedopt.kernels import lamb as klamb

    def fail(*args, **kwargs):
        raise RuntimeError("PTXAS error: injected")

    monkeypatch.setattr(klamb.lamb_pass2_kernel, "warmup", fail)
    monkeypatch.setattr(triton_backend, "_compiled", set())
    monkeypatch.setattr(backends, "_broken", {})
    monkeypatch.setitem(backends._AUTO_ORDER, DEVICE, ("triton", "eager"))


def test_auto_falls_back_with_one_warning_when_a_kernel_does_not_compile(broken_pass2):
    params, opt = _lamb_opt("auto")
    eager_params, eager = _lamb_opt("eager")
    with pytest.warns(RuntimeWarning) as caught:
        for seed in (1, 2):
            _set_grads(params, seed)
            _set_grads(eager_params, seed)
            opt.step()
            eager.step()
    messages = [str(w.message) for w in caught if "falls back" in str(w.message)]
    assert len(messages) == 1, messages
    assert all(s in messages[0] for s in ("triton", "lamb_pass2_kernel", "HAS_MASTER=False",
                                          "PTXAS error: injected", "'eager'"))
    # every step, the first included, was done by eager: nothing ran half on triton
    assert all(torch.equal(p, q) for p, q in zip(params, eager_params))


def test_explicit_backend_raises_on_a_compile_failure_and_changes_nothing(monkeypatch):
    params, opt = _lamb_opt("triton")
    _set_grads(params, 1)
    opt.step()
    before = [p.detach().clone() for p in params]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    _set_grads(params, 2)
    from fusedopt import backends
    from fusedopt.kernels import lamb as klamb
    monkeypatch.setattr(triton_backend, "_compiled", set())
    monkeypatch.setattr(klamb.lamb_pass2_kernel, "warmup",
                        lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected")))
    with pytest.raises(backends.BackendCompileError, match="lamb_pass2_kernel.*injected"):
        opt.step()
    assert all(torch.equal(b, p) for b, p in zip(before, params))
    assert all(torch.equal(st[k], v) for st, p in zip(state, params) for k, v in opt.state[p].items())


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
