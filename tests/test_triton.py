"""The Triton backend against the float64 reference, its launch count, tables and availability.

On a machine without CUDA the kernels run in Triton's interpreter on CPU tensors: that needs
TRITON_INTERPRET=1 before triton is first imported, so it is set here, before anything imports
triton (importing fusedopt does not; see Note [lazy import] in fusedopt/backends/triton_backend.py).
On a CUDA machine the same tests run the compiled kernels on the GPU.
The interpreter costs about a millisecond per operation of a program, so the tests shrink the
chunk layout (``small_tiles``) and use small shapes and few steps.
"""
import collections
import os
import subprocess
import sys

import pytest
import torch

from helpers import triton_module

INTERPRETED, DEVICE = triton_module()

from fusedopt import _errors  # noqa: E402
from fusedopt.backends import triton_backend  # noqa: E402
from fusedopt.backends.triton_backend import TritonBackend  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fusedopt.kernels import tables  # noqa: E402
from fusedopt.kernels.common import partial_slots  # noqa: E402
from helpers import (  # noqa: E402
    LAMB_CASES, LARS_CASES, SHAPES_SMALL, assert_nan_rule, assert_within_rounding, max_rel_err,
    nan_rule_runs, run_backend, tols,
)

import fusedopt  # noqa: E402

# The interpreter evaluates masked-off lanes too (0/0 of a zero-size tensor's trust ratio).
# gpu: on a CUDA machine every test of this file runs the compiled kernels (scripts/gpu_verify.py)
pytestmark = [pytest.mark.filterwarnings("ignore:(invalid value|divide by zero):RuntimeWarning"),
              pytest.mark.gpu]

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
    """Two rows per program and tensors of whole chunks: every program runs unmasked tiles (the
    shapes follow the chunk size, so that on a GPU they are whole chunks of 16384 too)."""
    monkeypatch.setattr(tables, "ROWS", 2)
    c = tables.CHUNK_SIZE
    params, ref, _ = _run(kind, {} if kind == "lamb" else LARS_CASES["default"],
                          shapes=[(4, c // 2), (c,), (3, c)])
    assert max_rel_err(params, ref) <= tols(torch.float32)


@pytest.mark.skipif(not INTERPRETED, reason="counts the interpreter's calls of tile_lanes; on a "
                                            "GPU the kernels run compiled")
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_whole_tiles_of_short_chunks_run_unmasked(kind, monkeypatch):
    """Note [whole tiles] in fusedopt/kernels/common.py: in chunks shorter than CHUNK_SIZE the tiles
    that lie inside every row run without a mask too (on a GPU: vector loads), the rest under the
    per-element mask, in every full-state loop (sq_norms for clipping, both passes)."""
    from fusedopt.kernels import common, lamb, lars
    phases, tile_lanes = [], common.tile_lanes

    def recorded(phase, o, n):
        phases.append(int(phase))
        return tile_lanes(phase, o, n)

    for module in (common, lamb, lars):
        monkeypatch.setattr(module, "tile_lanes", recorded)
    monkeypatch.setattr(tables, "ROWS", 2)
    tile = tables.BLOCK_SIZE
    assert tables.CHUNK_SIZE > 3 * tile  # the tensors below are one short chunk each
    hyper = dict(max_grad_norm=1.0, **({} if kind == "lamb" else LARS_CASES["default"]))
    params, ref, _ = _run(kind, hyper, shapes=[(2 * tile + tile // 2,), (5 * tile // 2,)],
                          steps=1)
    assert max_rel_err(params, ref) <= tols(torch.float32)
    # three loops (sq_norms, pass 1, pass 2), each two whole tiles and one masked one
    assert sorted(phases) == [0] * 6 + [1] * 3


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_learning_rate_tensor(kind):
    hyper = {} if kind == "lamb" else LARS_CASES["default"]
    lr = {"lamb": 1e-2, "lars": 0.5}[kind]
    params, ref, _ = _run(kind, hyper, lr=torch.tensor(lr), steps=2)
    assert max_rel_err(params, ref) <= tols(torch.float32)


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_tensor_lr_and_its_value_give_the_same_bits(kind):
    """Note [CPU tensor lr]: a CPU tensor lr of CUDA params is passed by value; the kernels read
    the same float64 through LR_TENSOR and through the number, so the results are bit-identical."""
    hyper = {} if kind == "lamb" else LARS_CASES["default"]
    lr = torch.tensor({"lamb": 1e-2, "lars": 0.5}[kind], dtype=torch.bfloat16)  # not a float32
    by_tensor, _, _ = _run(kind, hyper, lr=lr, steps=2)
    by_value, _, _ = _run(kind, hyper, lr=float(lr), steps=2)
    assert all(torch.equal(a, b) for a, b in zip(by_tensor, by_value))


def _fake_cuda_operands(monkeypatch, capturing=False):
    """``_lr_args`` for a CUDA device without one: its constant operands and capture state mocked,
    and every ``Tensor.to`` recorded (a copy of a CPU lr to the device would be one)."""
    copies = []
    real_to = torch.Tensor.to
    monkeypatch.setattr(tables, "operand", lambda device, dtype, value: torch.full((), value,
                                                                                   dtype=dtype))
    monkeypatch.setattr(tables, "capturing", lambda device: capturing)
    monkeypatch.setattr(_errors, "capturing", lambda device: capturing)

    def to(self, *args, **kwargs):
        copies.append((args, kwargs))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    return copies


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_cpu_tensor_lr_of_cuda_params_is_read_without_a_copy(monkeypatch, dtype):
    """Note [CPU tensor lr]: no blocking host-to-device copy per bucket and step; the value, read
    on the host (no device sync), travels as the number lr, with the flag LR_TENSOR clear."""
    lr = torch.tensor(0.1, dtype=dtype)
    copies = _fake_cuda_operands(monkeypatch)
    kw = triton_backend._lr_args(lr, torch.device("cuda", 0))
    assert copies == [] and kw["lr_flag"] == 0
    assert kw["lr"] == float(lr.double()) and float(kw["lr_ptr"]) == 0.0
    # a tensor lr on the params' device (here the interpreter's CPU) is still read by the kernels
    kw = triton_backend._lr_args(lr, torch.device("cpu"))
    assert kw["lr_flag"] == tables.LR_TENSOR and kw["lr_ptr"].dtype == torch.float64 and kw["lr"] == 0.0


def test_cpu_tensor_lr_is_refused_in_a_capture(monkeypatch):
    """A captured launch would keep the value of the captured step at every replay."""
    _fake_cuda_operands(monkeypatch, capturing=True)
    with pytest.raises(RuntimeError, match="CPU tensor lr cannot be captured in a CUDA graph"):
        triton_backend._lr_args(torch.tensor(0.1), torch.device("cuda", 0))
    # a number lr or a device tensor lr is captured as before
    assert triton_backend._lr_args(0.1, torch.device("cuda", 0))["lr"] == 0.1


def _steps_with_lr(kind, lr, steps=3, sync_mode=None):
    """Params after ``steps`` steps with ``lr``; ``sync_mode`` applies to every step after the
    first (which reads a new tensor lr once, compiles and builds the tables)."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(4097,), (33,), (0,), (3, 5)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(DEVICE)) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(DEVICE) for s in shapes] for _ in range(steps)]
    cls = fusedopt.FusedLAMB if kind == "lamb" else fusedopt.FusedLARS
    opt = cls(params, lr=lr, backend="triton", max_grad_norm=1.0)
    for k in range(steps):
        for p, g in zip(params, grads[k]):
            p.grad = g
        if k and sync_mode:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode(sync_mode)
        try:
            opt.step()
        finally:
            if k and sync_mode:
                torch.cuda.set_sync_debug_mode("default")
    return [p.detach() for p in params]


@pytest.mark.skipif(INTERPRETED, reason="needs a CUDA device (a CPU tensor lr of CUDA params)")
@pytest.mark.parametrize("lr_device", ["cpu", "cuda"])
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_tensor_lr_steps_without_a_host_sync_on_the_gpu(kind, lr_device):
    """No host sync in a step (torch's sync debug mode raises on one) with a CPU or a CUDA tensor
    lr, and the bits of the number lr."""
    value = {"lamb": 1e-2, "lars": 0.5}[kind]
    by_value = _steps_with_lr(kind, value)
    got = _steps_with_lr(kind, torch.tensor(value, device=lr_device), sync_mode="error")
    assert all(torch.equal(a, b) for a, b in zip(got, by_value))


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


@pytest.mark.parametrize("compiled", [False, True], ids=["uncompiled", "compiled"])
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_each_launch_is_built_once_per_step(kind, compiled, monkeypatch):
    """Note [triton operators]: a step builds the arguments of each launch once (the kernels are
    compiled from them, then launched with the step's runtime operands), uncompiled and under
    ``torch.compile``: 3 groups with clipping, one table each."""
    params, opt = _groups_opt(kind, 3, max_grad_norm=1.0)
    built = collections.Counter()
    for name in ("pass1_launches", "pass2_launches", "sq_norms_launches"):
        def counted(*args, _real=getattr(triton_backend, name), _name=name, **kw):
            built[_name] += 1
            return _real(*args, **kw)
        monkeypatch.setattr(triton_backend, name, counted)
    if compiled:
        torch._dynamo.reset()
    step = torch.compile(opt.step) if compiled else opt.step
    for i in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        built.clear()
        before = tables.launch_count()
        step()
        assert tables.launch_count() - before == 9
        if i:  # the first compiled step traces too
            assert built == {"pass1_launches": 3, "pass2_launches": 3, "sq_norms_launches": 3}
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


def test_failed_launch_names_the_kernel_after_a_sticky_device_error():
    """After a sticky CUDA error every later device call fails, the reset of the counters too: the
    error raised still names the kernel and the launch's cause (mocked: no device here)."""
    class Counters:
        def zero_(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def lamb_pass2_kernel():
        pass

    class Broken:
        fn = staticmethod(lamb_pass2_kernel)

        def __getitem__(self, grid):
            def run(**kw):
                raise RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered")
            return run

    table = tables.Table(device=torch.device(DEVICE), n=1, num_chunks=1, num_programs=1,
                         records=None, owner=None, counters=Counters(), aligned=True)
    with pytest.raises(tables.KernelError, match=r"kernel lamb_pass2_kernel .*ALIGNED=True.*"
                       r"Triton Error \[CUDA\].*counters could not be reset.*illegal memory"):
        tables.launch(Broken(), table, ALIGNED=True, CHUNK=2048)


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
    if not INTERPRETED:  # over one GPU chunk as well
        xs.append(torch.randn(3 * tables.CHUNK_SIZE + 7, generator=gen).to(DEVICE))
    be = TritonBackend()
    first = be.sq_norms(xs)
    monkeypatch.setattr(tables, "ROWS", 1 if tables.ROWS != 1 else 2)  # on a GPU ROWS is 1
    assert torch.equal(be.sq_norms(xs), first)
    expect = torch.stack([(x.double() ** 2).sum() for x in xs]).float()
    torch.testing.assert_close(first, expect, rtol=1e-6, atol=0)


# ------------------------------------------------------- the finaliser of the two-stage norms
# Note [two-stage norms] (kernels/common.py): each chunk stores its partial sums, and the last
# program to finish a tensor (acq_rel counter) sums the tensor's partials, REDUCE_BLOCK lanes at a
# time: a tensor of more than REDUCE_BLOCK chunks (over 2.1M elements with the GPU's tiles) takes
# the finaliser's loop more than once. Under the interpreter REDUCE_BLOCK is lowered so that a few
# chunks do.
FINALISER_SHAPES = [(7 * 2048 + 5,), (3,), (5 * 2048,), (0,), (2048 + 1,)]


def _norm_inputs(shapes, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).to(DEVICE, dtype) for s in shapes]


@pytest.mark.skipif(not INTERPRETED, reason="interpreter tiles: lowers REDUCE_BLOCK and ROWS")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_finaliser_loop_over_many_partials_under_the_interpreter(monkeypatch, dtype):
    """REDUCE_BLOCK of 2: the finaliser loops up to four times (8 chunks), with tensors of other
    chunk counts finishing in the same program; ROWS of 1 puts every chunk in its own program,
    so a tensor's last program is another than its first. The sums are the same bits for every
    ROWS (the partials and their order do not depend on it) and match the float64 sums."""
    xs = _norm_inputs(FINALISER_SHAPES, dtype)
    be = TritonBackend()
    monkeypatch.setattr(tables, "REDUCE_BLOCK", 2)
    by_rows = {}
    for rows in (64, 2, 1):
        monkeypatch.setattr(tables, "ROWS", rows)
        by_rows[rows] = be.sq_norms(xs)
    assert all(torch.equal(by_rows[64], v) for v in by_rows.values())
    expect = torch.stack([(x.double() ** 2).sum() for x in xs]).to(by_rows[1].dtype)
    torch.testing.assert_close(by_rows[1], expect, rtol=1e-6 if dtype == torch.float32 else 1e-12,
                               atol=0)


@pytest.mark.skipif(not INTERPRETED, reason="interpreter tiles: lowers REDUCE_BLOCK and ROWS")
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_steps_with_a_looping_finaliser_match_reference(monkeypatch, kind):
    """Both passes' norms (and the clipping total of LAMB) through a finaliser loop of several
    iterations, one chunk per program."""
    monkeypatch.setattr(tables, "REDUCE_BLOCK", 2)
    monkeypatch.setattr(tables, "ROWS", 1)
    hyper = dict(max_grad_norm=1.0) if kind == "lamb" else LARS_CASES["default"]
    params, ref, _ = _run(kind, hyper, shapes=FINALISER_SHAPES, steps=2)
    assert max_rel_err(params, ref) <= tols(torch.float32)


# On a GPU (compiled kernels, CHUNK_SIZE 16384, ROWS 1, REDUCE_BLOCK 128): tensors over one chunk
# (the unmasked vector loop, norms finished by another program than the first) and over 128
# chunks (the finaliser's loop runs twice). Too large for the interpreter.
GPU_CHUNK = 16384
GPU_SHAPES = [(3 * GPU_CHUNK + 77,), (129 * GPU_CHUNK + 5,), (GPU_CHUNK,), (5,), (0,)]
needs_gpu = pytest.mark.skipif(INTERPRETED, reason="needs a CUDA device: tensors of up to 130 "
                               "chunks of 16384 elements (the interpreter runs the lowered "
                               "REDUCE_BLOCK tests above instead)")


@needs_gpu
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_tensors_over_one_and_over_128_chunks_on_the_gpu(kind):
    assert tables.CHUNK_SIZE == GPU_CHUNK and tables.REDUCE_BLOCK * GPU_CHUNK < 129 * GPU_CHUNK
    hyper = dict(max_grad_norm=1.0) if kind == "lamb" else LARS_CASES["default"]
    params, ref, _ = _run(kind, hyper, shapes=GPU_SHAPES, steps=2)
    assert max_rel_err(params, ref) <= tols(torch.float32)


@needs_gpu
def test_norms_over_128_chunks_on_the_gpu_are_deterministic():
    xs = _norm_inputs(GPU_SHAPES)
    xs.append(_norm_inputs([(3 * GPU_CHUNK + 78,)])[0][1:])  # misaligned, over one chunk
    be = TritonBackend()
    first = be.sq_norms(xs)
    assert all(torch.equal(be.sq_norms(xs), first) for _ in range(3))
    expect = torch.stack([(x.double() ** 2).sum() for x in xs]).float()
    torch.testing.assert_close(first, expect, rtol=1e-5, atol=0)


@needs_gpu
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_misaligned_tensors_over_one_chunk_on_the_gpu(kind):
    """A param and grad 4 bytes past a 16-byte boundary: the misaligned kernels over many chunks."""
    n = 3 * GPU_CHUNK + 77
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(n + 1, generator=gen).to(DEVICE)
    p = torch.nn.Parameter(base[1:])
    assert p.data_ptr() % 16
    ref_p = torch.nn.Parameter(base[1:].clone())
    opts = [(fusedopt.FusedLAMB if kind == "lamb" else fusedopt.FusedLARS)([x], lr=0.01,
                                                                         backend=be)
            for x, be in ((p, "triton"), (ref_p, "eager"))]
    for step in range(2):
        g = torch.randn(n + 1, generator=gen).to(DEVICE)
        p.grad, ref_p.grad = g[1:], g[1:].clone()
        for opt in opts:
            opt.step()
    assert max_rel_err([p], [ref_p]) <= 1e-5


@triton.jit
def _partial_slot_offset(base, out, C: tl.constexpr):
    """``out[0]``: the byte offset from ``base`` of chunk C's partial sums."""
    c = tl.full([1], C, tl.int32) + tl.program_id(0)
    slot = partial_slots(base, c)
    tl.store(out + tl.arange(0, 1), slot.to(tl.int64) - base.to(tl.int64))


def test_partial_sums_of_chunks_past_2_30_are_addressed_in_64_bits():
    """``partials + 2·c`` with the int32 chunk index ``c``: 2·c must not wrap past 2**30 chunks
    (a tensor of 2**30 chunks is out of reach of a test; the address arithmetic is not)."""
    base = torch.zeros(2, device=DEVICE)
    out = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    chunk = 2**30 + 3
    _partial_slot_offset[(1,)](base, out, C=chunk)
    assert int(out) == 2 * chunk * base.element_size()


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


def _alignment_as_triton_specializes(kernel, kw):
    """The tensor arguments of a launch with the alignment Triton specializes each on (None where
    the kernel is declared not to: Note [scalar operands])."""
    fn_kwargs = getattr(kernel, "kwargs", {})
    loose = (getattr(kernel, "do_not_specialize_on_alignment", None)
             or fn_kwargs.get("do_not_specialize_on_alignment") or ())
    return tuple((k, str(v.dtype), None if k in loose else v.data_ptr() % 16 == 0)
                 for k, v in kw.items() if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_misaligned_scalar_operands_are_compiled_before_the_step(kind, monkeypatch):
    """Note [scalar operands]: a tensor lr that is a 0-dim view (``lrs[1]``, 8 bytes past a 16-byte
    boundary) and a misaligned ``found_inf`` launch the specializations ``prepare`` compiled, not
    new ones compiled mid-step after pass 1 ran."""
    lrs = torch.tensor([0.01, 0.02], dtype=torch.float64, device=DEVICE)
    flags = torch.zeros(2, device=DEVICE)
    assert lrs[1].data_ptr() % 16 and flags[1].data_ptr() % 16
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(DEVICE)) for s in [(33,), (7,)]]
    cls = fusedopt.FusedLAMB if kind == "lamb" else fusedopt.FusedLARS
    opt = cls(params, lr=lrs[1], backend="triton")
    compiled, launched = set(), []
    real_launch = tables.launch
    monkeypatch.setattr(triton_backend, "_compiled", set())
    monkeypatch.setattr(tables, "compile_only", lambda kernel, table, **kw: compiled.add(
        (kernel, _alignment_as_triton_specializes(kernel, kw))))

    def launch(kernel, table, **kw):
        launched.append((kernel, _alignment_as_triton_specializes(kernel, kw)))
        real_launch(kernel, table, **kw)

    monkeypatch.setattr(tables, "launch", launch)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(DEVICE)
    opt.grad_scale, opt.found_inf = torch.tensor(2.0, device=DEVICE), flags[1]
    opt.step()
    assert launched and all(spec in compiled for spec in launched), \
        [spec for spec in launched if spec not in compiled]
    assert any(k == "lr_ptr" for _, spec in launched for k, *_ in spec)


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
