"""The Triton backend's low-precision state (docs/math.md, "Low-precision state") against the cpp
backend, bit for bit: every param, master, step count and byte of state, over steps with bf16,
8-bit and full state in one launch, global clipping and a skipped (found_inf) step.

The elementwise math of both backends is one IEEE rounding per operation in the same order, so
the states and updates agree to the bit; the per-tensor sums of squares (‖w‖², ‖u‖²; the grads'
‖g‖² of clipping) are reduced in a different order by each backend (float32 tiles here, float64
partials in C++) and agree only to rounding. So the Triton run takes the cpp run's sums through
the engine's ``reducer`` hook (as an all-reduce would hand them), after checking that its own are
within rounding of them: what is compared bit for bit is everything downstream of the sums.

Under the interpreter (no GPU) the kernels run on CPU tensors with the interpreter's tiles
(chunks of 2048 elements, 64 per program, tiles of 512 columns: tensors of several formats share
a program); on a CUDA machine the Triton run is on the GPU with the GPU tiles and the cpp run on
CPU copies.
"""
import math

import pytest
import torch

from helpers import triton_module

INTERPRETED, DEVICE = triton_module()

from fusedopt import backends, functional, lowp  # noqa: E402
from fusedopt._hyper import LAMB_DEFAULTS, LARS_DEFAULTS, lamb_hyper, lars_hyper  # noqa: E402
from fusedopt.backends import triton_backend  # noqa: E402
if backends.get_backend("cpp") is None:
    pytest.skip(f"the cpp backend is not available: {backends.load_error('cpp')}",
                allow_module_level=True)

from fusedopt.kernels import tables  # noqa: E402

# The interpreter evaluates masked-off lanes too (0/0 of lanes past a tensor's end).
pytestmark = [pytest.mark.filterwarnings("ignore:(invalid value|divide by zero):RuntimeWarning"),
              pytest.mark.gpu]  # scripts/gpu_verify.py runs it on a GPU against the cpp bytes

# Not multiples of 256 (blocks with a short last one), below a tile (512 under the interpreter),
# between a tile and a chunk (2048), over one and two chunks; whole blocks; a tiny tensor.
SHAPES = [(300,), (7, 100), (2500,), (5,), (4097,), (3, 700), (1024,), (256,)]
FORMATS = {"bf16": ["bf16"] * len(SHAPES), "8bit": ["8bit"] * len(SHAPES),
           "mixed": ["8bit", "bf16", "full", "8bit", "bf16", "full", "8bit", "bf16"]}


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """The interpreter's tiles (as tests/test_triton.py); the GPU tiles on a GPU."""
    if INTERPRETED:
        for name, value in tables.INTERPRETER_TILES.items():
            monkeypatch.setattr(tables, name, value)


class _Record:
    """The cpp run's reducer: keeps its grads' total Σg² and its trust sums, step by step."""

    def __init__(self):
        self.grad_sq, self.sums = [], []

    def reduce_grad_sq(self, total):
        self.grad_sq.append(total.clone())

    def reduce_trust_sums(self, sums, buckets):
        self.sums.append([s.clone() for s in sums])


class _Replay:
    """The Triton run's reducer: checks that its sums are within rounding of the cpp run's and
    replaces them with those (module docstring). ``unchecked``: steps whose sums are not
    compared (a skipped step's are not read)."""

    def __init__(self, record: _Record, unchecked=()):
        self.record, self.unchecked, self.step = record, unchecked, 0

    def reduce_grad_sq(self, total):
        ref = self.record.grad_sq[self.step]
        torch.testing.assert_close(total.cpu(), ref, rtol=1e-5, atol=0, equal_nan=True)
        total.copy_(ref)

    def reduce_trust_sums(self, sums, buckets):
        for s, ref in zip(sums, self.record.sums[self.step]):
            if self.step not in self.unchecked:
                torch.testing.assert_close(s.cpu(), ref, rtol=1e-5, atol=1e-30, equal_nan=True)
            s.copy_(ref)
        self.step += 1


def _zeros(p, fmt, misaligned):
    """Zero state of ``fmt`` for ``p``; ``misaligned``: 4 bytes into a buffer (not 16-byte
    aligned: such tensors get tables of their own, Note [per-tensor alignment])."""
    x = lowp.zeros(p, fmt)
    if not misaligned:
        return x
    raw = torch.zeros(x.numel() * x.element_size() + 4, dtype=torch.uint8, device=p.device)
    return raw[4:].view(x.dtype).view(x.shape)


def _run(kind, backend, device, fmts, opts, *, shapes=SHAPES, steps=3, skip=(), dtype=None,
         master=False, keys=None, reducer=None, grads_hook=None, misaligned=False):
    """``steps`` steps of ``kind`` on ``backend`` (``skip``: the steps with found_inf = 1) over
    params of ``shapes`` whose state is in ``fmts``; returns every tensor of the run (CPU)."""
    dtype = dtype or torch.float32
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen).to(dtype).to(device) for s in shapes]
    masters = [p.float().clone() for p in params] if master else None
    step_counts = [torch.zeros((), device=device) for _ in params]

    def zeros():  # misaligned: every other tensor
        return [_zeros(p, f, misaligned and i % 2 == 0)
                for i, (p, f) in enumerate(zip(params, fmts))]

    if kind == "lamb":
        state = dict(exp_avgs=zeros(), exp_avg_sqs=zeros())
        hyper = lamb_hyper({**LAMB_DEFAULTS, "lr": 1e-2, **opts})
    else:
        state = dict(momentum_buffers=zeros())
        hyper = lars_hyper({**LARS_DEFAULTS, "lr": 0.5, **opts})
    for t in range(steps):
        grads = [(torch.randn(s, generator=gen) * 0.1).to(dtype).to(device) for s in shapes]
        if grads_hook is not None:
            grads_hook(t, grads)
        group = functional.TensorGroup(params, grads, step_counts, masters=masters, keys=keys,
                                       hyper=hyper, backend=backend, **state)
        found_inf = torch.tensor(1.0 if t in skip else 0.0, device=device)
        functional.trust_ratio_step(kind, [group], found_inf=found_inf, reducer=reducer)
    out = params + step_counts + (masters or [])
    for xs in state.values():
        out += xs
    return [x.cpu() for x in out]


def _bytes(x):
    return x.contiguous().view(-1).view(torch.uint8)


def _compare(kind, fmts, opts, **kw):
    """The cpp and Triton runs, every tensor compared byte for byte."""
    record = _Record()
    ref = _run(kind, "cpp", "cpu", fmts, opts, reducer=record, **kw)
    got = _run(kind, "triton", DEVICE, fmts, opts, reducer=_Replay(record, kw.get("skip", ())),
               **kw)
    assert len(ref) == len(got)
    bad = [i for i, (a, b) in enumerate(zip(ref, got)) if not torch.equal(_bytes(a), _bytes(b))]
    assert not bad, f"tensors {bad} of {len(ref)} differ (params, steps, masters, states)"
    return ref, got


# ----------------------------------------------------------------------------------- LAMB
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_lamb_matches_cpp(fmt):
    """Global clipping and a skipped step between two steps."""
    _compare("lamb", FORMATS[fmt], dict(max_grad_norm=1.0), steps=4, skip=(1,))


def test_lamb_options_and_keys_match_cpp():
    """Decoupled weight decay, bounds, no bias correction, and keys that are not the indices
    (the random bits of v's stochastic rounding follow the key), some with a high half (the
    first element of a run of a tensor, docs/math.md "Random bits"; -1: 2^32 - 1)."""
    keys = torch.tensor([5 | 1000 << 32, 0, 11, 2 | -1 << 32, 3, 9 | 256 << 32, 1, 4])
    ref, _ = _compare("lamb", FORMATS["mixed"],
                      dict(decoupled_weight_decay=True, weight_decay=0.1, bias_correction=False,
                           trust_ratio_bounds=(0.0, 10.0)), keys=keys, steps=2)
    other, _ = _compare("lamb", FORMATS["mixed"],
                        dict(decoupled_weight_decay=True, weight_decay=0.1, bias_correction=False,
                             trust_ratio_bounds=(0.0, 10.0)), steps=2)
    n = len(SHAPES)
    v_states = ref[-n:], other[-n:]  # exp_avg_sqs: stochastically rounded
    assert any(not torch.equal(_bytes(a), _bytes(b)) for a, b in zip(*v_states))


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_misaligned_state_matches_cpp(kind, monkeypatch):
    """State that is not 16-byte aligned (a packed tensor needs only 4): every other tensor goes
    to a launch of its own (Note [per-tensor alignment]), with the same results."""
    launches = []
    launch = tables.launch
    monkeypatch.setattr(tables, "launch", lambda kernel, table, **kw: (
        launches.append(table.aligned), launch(kernel, table, **kw)))
    _compare(kind, FORMATS["mixed"], {}, steps=2, misaligned=True)
    assert set(launches) == {True, False}


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_whole_tiles_and_the_rest_match_cpp(kind):
    """Note [whole tiles] in fusedopt/kernels/common.py: a program whose every row is a chunk of
    whole tiles (the shortest row ends exactly where the tiles walked without a per-element mask
    end), beside rows that go on under the mask. A program fills its rows here (a padding row is
    empty and leaves no whole tile), and the last row is longer than the others."""
    rows = tables.ROWS if tables.ROWS > 1 else 4
    tile = tables.BLOCK_SIZE
    shapes = [(2 * tile,)] * (rows - 1) + [(2 * tile + tile // 2,)]
    fmts = ["8bit", "bf16"] * (rows // 2) + ["8bit"] * (rows % 2)
    _compare(kind, fmts, {}, shapes=shapes, steps=2)


# ----------------------------------------------------------------------------------- LARS
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_lars_matches_cpp(fmt):
    _compare("lars", FORMATS[fmt], dict(weight_decay=1e-4, max_grad_norm=1.0), steps=4,
             skip=(1,))


@pytest.mark.parametrize("opts", [dict(nesterov=True, weight_decay=1e-4),
                                  dict(lr_in_momentum=False, nesterov=True, dampening=0.1,
                                       denominator="combined", trust_clip=True)],
                         ids=["nesterov", "torch_sgd_form"])
def test_lars_options_match_cpp(opts):
    _compare("lars", FORMATS["mixed"], opts)


def test_ties_round_to_nearest_even():
    """LARS's first step in the torch-SGD form without adaptation or decay stores the gradient
    itself as the buffer: gradients halfway between two bf16 values or two 8-bit codes round to
    the even one, in both backends."""
    ties = torch.tensor([1.875, 1.0625, 1.1875, -1.0625, 1 + 2**-8, 1 + 3 * 2**-8])

    def hook(t, grads):
        for g in grads:
            g.view(-1)[:len(ties)] = ties.to(g.device, g.dtype) if g.numel() >= len(ties) else 0

    opts = dict(adapt=False, lr_in_momentum=False, weight_decay=0.0)
    fmts = ["8bit", "bf16"] * (len(SHAPES) // 2)
    ref, _ = _compare("lars", fmts, opts, steps=1, grads_hook=hook)
    eight, half = ref[-len(SHAPES)], ref[-len(SHAPES) + 1]
    scales, codes = lowp.split(eight, 300)
    assert scales[0] == 1.0
    assert lowp.decode_signed(codes[:4].view(torch.int8), scales[:1]).tolist() == [
        1.875, 1.0, 1.25, -1.0]
    assert half.view(-1)[4:6].float().tolist() == [1.0, 1 + 4 * 2**-8]


# --------------------------------------------------------------------------- fp32 masters
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_masters_match_cpp(kind, dtype):
    """bf16/fp16 params with fp32 masters: the params are the masters rounded to nearest even."""
    opts = dict(max_grad_norm=1.0) if kind == "lamb" else dict(weight_decay=1e-4)
    _compare(kind, FORMATS["mixed"], opts, dtype=dtype, master=True, steps=2)


# ------------------------------------------------------------------------------ NaN rule
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_a_block_that_is_not_finite(kind):
    """An inf gradient: its 8-bit block stores the scale NaN and codes 0, the other blocks of the
    tensor are stored as usual, and both backends give the same NaN positions (NaN bits are
    compared as NaN: their payloads are not part of the contract)."""
    def hook(t, grads):
        if t == 1:
            grads[2][600] = float("inf")  # block 2 of the 2500-element tensor

    fmts = FORMATS["mixed"][:3] + ["8bit"] * (len(SHAPES) - 3)
    fmts[2] = "8bit"
    kw = dict(steps=2, grads_hook=hook)
    record = _Record()
    ref = _run(kind, "cpp", "cpu", fmts, {}, reducer=record, **kw)
    got = _run(kind, "triton", DEVICE, fmts, {}, reducer=_Replay(record), **kw)
    n = len(SHAPES)
    for a, b in zip(ref, got):
        if a.dtype == torch.uint8:
            continue
        assert torch.equal(a.isnan(), b.isnan())
        assert torch.equal(torch.nan_to_num(a, 0.0), torch.nan_to_num(b, 0.0))
    state = ref[-n if kind == "lars" else -2 * n:]
    got_state = got[-n if kind == "lars" else -2 * n:]
    for i, (a, b) in enumerate(zip(state, got_state)):
        if a.dtype != torch.uint8:
            continue
        size = math.prod(SHAPES[i % n])
        sa, ca = lowp.split(a, size)
        sb, cb = lowp.split(b, size)
        assert torch.equal(ca, cb)
        assert torch.equal(sa.isnan(), sb.isnan())
        assert torch.equal(torch.nan_to_num(sa, 0.0), torch.nan_to_num(sb, 0.0))
    scales, codes = lowp.split(got_state[2], 2500)
    assert scales[2].isnan() and not scales[[0, 1, 3, 4, 5, 6, 7, 8, 9]].isnan().any()
    assert not codes[512:768].any()


# ---------------------------------------------------------------------------- optimizer
@pytest.fixture
def triton_as_cpp():
    """fusedopt/optim.py refuses ``backend="triton"`` with low-precision state (until that is
    lifted): the optimizer's ``"cpp"`` runs the Triton backend here instead."""
    old = backends.set_backend("cpp", triton_backend.TritonBackend())
    yield
    backends.set_backend("cpp", old)


def _optimizer_run(device, compiled=False):
    """Three LAMB steps of the optimizer with 8-bit state for the params of at least 1000
    elements (full below) in one group and bf16 state in another, a param without a gradient in
    the second step (the keys of the others are their indices in the group, not in the bucket)."""
    import fusedopt
    gen = torch.Generator().manual_seed(3)
    shapes = [(5000,), (300,), (4097,), (7, 100), (2500,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in shapes]
    opt = fusedopt.FusedLAMB([
        {"params": params[:3], "state_precision": "8bit", "state_min_numel": 1000},
        {"params": params[3:], "state_precision": "bf16", "state_min_numel": 0}],
        lr=1e-2, max_grad_norm=1.0, backend="cpp")
    if compiled:
        torch._dynamo.reset()
    step = torch.compile(opt.step) if compiled else opt.step
    for t in range(3):
        for i, p in enumerate(params):
            g = torch.randn(p.shape, generator=gen).to(device)
            p.grad = None if (t == 1 and i == 0) else g
        step()
    state = [opt.state[p][k].cpu() for p in params for k in ("exp_avg", "exp_avg_sq", "step")]
    return [p.detach().cpu() for p in params], state


def test_optimizer_state_matches_cpp(triton_as_cpp):
    """LAMB's moments do not depend on the params, so the optimizer's states (with the keys the
    optimizer gives) equal the cpp backend's bit for bit; the params agree to rounding (their
    trust ratios come from sums reduced in another order)."""
    got_p, got_s = _optimizer_run(DEVICE)
    backends.set_backend("cpp", None)  # the real one
    ref_p, ref_s = _optimizer_run("cpu")
    assert [x.dtype for x in got_s[::3]] == [torch.uint8, torch.float32, torch.uint8,
                                             torch.bfloat16, torch.bfloat16]
    assert all(torch.equal(_bytes(a), _bytes(b)) for a, b in zip(ref_s, got_s))
    for a, b in zip(ref_p, got_p):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_compiled_optimizer_step_equals_uncompiled(triton_as_cpp, monkeypatch):
    """``torch.compile(opt.step)`` runs the Triton operators (Note [triton operators]), which take
    the keys: the same bits as the uncompiled step."""
    run_pass1, seen = triton_backend.run_pass1, []

    def recording(*args, keys=None, **kw):
        seen.append(None if keys is None else keys.tolist())
        return run_pass1(*args, keys=keys, **kw)

    runs = [_optimizer_run(DEVICE, False)]
    monkeypatch.setattr(triton_backend, "run_pass1", recording)
    runs.append(_optimizer_run(DEVICE, True))
    assert [1, 2] in seen  # the operator's keys of the first group in the second step
    for a, b in zip(runs[0][0] + runs[0][1], runs[1][0] + runs[1][1]):
        assert torch.equal(_bytes(a), _bytes(b))


# ------------------------------------------------------------------------------- tables
def test_tables_record_formats_and_keys_and_are_kept():
    """The records carry each tensor's format and key; a step with the same tensors builds no
    table, one whose state changed format builds new ones."""
    gen = torch.Generator().manual_seed(1)
    params = [torch.randn(s, generator=gen).to(DEVICE) for s in ((300,), (600,), (40,))]
    fmts = ["8bit", "full", "bf16"]
    ms = [lowp.zeros(p, f) for p, f in zip(params, fmts)]
    vs = [lowp.zeros(p, f) for p, f in zip(params, fmts)]
    steps = [torch.zeros((), device=DEVICE) for _ in params]
    store = tables.TableStore()
    lists = [params, params, None, ms, vs, steps]
    keys = torch.tensor([7, 8, 9])
    tabs = tables.tables(lists, store, keys=keys)
    rec = torch.cat([t.records.cpu() for t in tabs])
    assert sorted(rec[:, tables.FORMAT].tolist()) == [0, 1, 2]
    assert {(int(r[tables.OUT]), int(r[tables.FORMAT]), int(r[tables.KEY])) for r in rec} == {
        (0, 2, 7), (1, 0, 8), (2, 1, 9)}
    built = tables.build_count()
    assert tables.tables(lists, store, keys=keys) is tabs
    assert tables.build_count() == built
    ms[1], vs[1] = lowp.zeros(params[1], "bf16"), lowp.zeros(params[1], "bf16")
    assert tables.tables(lists, store, keys=keys) is not tabs
    full = [torch.zeros_like(p) for p in params]
    rec = torch.cat([t.records.cpu() for t in tables.tables([params, params, None, full, full,
                                                             steps])])
    assert not rec[:, tables.FORMAT].any()


def test_tiles_of_whole_blocks_are_required(monkeypatch):
    """8-bit blocks are cut from a tensor's first element: tiles (and chunks) must hold whole
    blocks of 256 elements."""
    monkeypatch.setattr(tables, "BLOCK_SIZE", 128)
    p = torch.randn(300, device=DEVICE)
    with pytest.raises(ValueError, match="multiples of 256"):
        functional.lamb([p], [torch.randn_like(p)], [lowp.zeros(p, "8bit")],
                        [lowp.zeros(p, "8bit")], [torch.zeros((), device=DEVICE)],
                        backend="triton")


def test_the_backend_declares_the_formats():
    assert set(triton_backend.TritonBackend.state_formats) == set(lowp.FORMATS)
