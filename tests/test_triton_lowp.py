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

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fusedopt.kernels import math as km  # noqa: E402
from fusedopt.kernels import tables  # noqa: E402

# The interpreter evaluates masked-off lanes too (0/0 of lanes past a tensor's end), and the
# corners of the maps square gradients whose squares overflow (v saturates).
pytestmark = [pytest.mark.filterwarnings(
                  "ignore:(invalid value|divide by zero|overflow):RuntimeWarning"),
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


def _same_nan_positions(a, b):
    """Equal values, NaN compared as NaN (a NaN's payload in a weight is not part of the
    contract: docs/math.md fixes the NaN of the state only)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(torch.nan_to_num(a, 0.0),
                                                             torch.nan_to_num(b, 0.0))


def _compare(kind, fmts, opts, *, nan_weights=False, **kw):
    """The cpp and Triton runs, every tensor compared byte for byte; ``nan_weights``: the
    params, step counts and masters with NaN compared as NaN (the states still byte for byte)."""
    record = _Record()
    ref = _run(kind, "cpp", "cpu", fmts, opts, reducer=record, **kw)
    got = _run(kind, "triton", DEVICE, fmts, opts, reducer=_Replay(record, kw.get("skip", ())),
               **kw)
    assert len(ref) == len(got)
    n_state = len(fmts) * (2 if kind == "lamb" else 1)
    bad = [i for i, (a, b) in enumerate(zip(ref, got))
           if not (torch.equal(_bytes(a), _bytes(b))
                   or (nan_weights and i < len(ref) - n_state and _same_nan_positions(a, b)))]
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


def test_ties_and_the_dynamic_map_s_edges():
    """LARS's first step in the torch-SGD form without adaptation or decay stores the gradient
    itself as the buffer: in both backends, gradients halfway between two bf16 values round to
    the even one, and the 8-bit buffer (docs/math.md, "8-bit": the code of the nearest value)
    codes the block's largest magnitude as ±127, the float below 1 as 127 (nearer to 1 than to
    ``V[126]``), ``V[126]`` as 126, and a midpoint ``M[c]`` between two codes as ``c + 1``, the
    float below it as ``c``: at the bottom of the map (0 and 1), across the edge of the top decade
    (63 and 64) and inside it (64 and 65)."""
    values = lowp._DYNAMIC  # V[mag], float32

    def mid(c):  # M[c] = (V[c] + V[c + 1])·0.5 in float32
        return ((values[c] + values[c + 1]) * 0.5).item()

    def below(x):
        return torch.nextafter(torch.tensor(x), torch.tensor(0.0)).item()

    edges = torch.tensor([1.0, -1.0, mid(0), below(mid(0)), mid(63), below(mid(63)), mid(64),
                          below(mid(64)), below(1.0), values[126].item()])
    ties = torch.tensor([0.5 + 2.0 ** -9, 0.5 + 3 * 2.0 ** -9])  # bf16 steps of 2^-8 here

    def hook(t, grads):
        grads[0].view(-1)[:len(edges)] = edges.to(grads[0].device, grads[0].dtype)
        grads[1].view(-1)[:len(ties)] = ties.to(grads[1].device, grads[1].dtype)

    opts = dict(adapt=False, lr_in_momentum=False, weight_decay=0.0)
    fmts = ["8bit", "bf16"] * (len(SHAPES) // 2)
    ref, _ = _compare("lars", fmts, opts, steps=1, grads_hook=hook)
    eight, half = ref[-len(SHAPES)], ref[-len(SHAPES) + 1]
    words, codes = lowp.split(eight, 300)
    assert words[0].tolist() == [torch.tensor(1.0).view(torch.int32).item(), 0]  # (bits(a), 0)
    assert codes[:len(edges)].view(torch.int8).tolist() == [127, -127, 1, 0, 64, 63, 65, 64, 127,
                                                            126]
    assert half.view(-1)[:2].float().tolist() == [0.5, 0.5 + 2.0 ** -7]


# ----------------------------------------------------------------------- the helpers
@triton.jit
def _helper(x_ptr, bits_ptr, out_ptr, N: tl.constexpr, WHAT: tl.constexpr):
    """One of the helpers of fusedopt/kernels/math.py applied to a vector: the rounding of the
    linear map (``rint`` by the magic number), ``V[mag]`` of the dynamic map, the bf16
    roundings."""
    i = tl.arange(0, N)
    if WHAT == 0:
        out = km.q8_direction_code(tl.load(x_ptr + i), tl.full([N], 1.0, tl.float32))
    elif WHAT == 1:
        out = km.q8_dynamic_unit(i).to(tl.int32, bitcast=True)
    elif WHAT == 2:
        out = km.bf16_rne(tl.load(x_ptr + i)).to(tl.int32)
    else:
        out = km.bf16_stochastic(tl.load(x_ptr + i),
                                 tl.load(bits_ptr + i).to(tl.uint32, bitcast=True)).to(tl.int32)
    tl.store(out_ptr + i, out)


def _apply(what, x=None, bits=None, n=None):
    """:func:`_helper` (``what``: the helper) over ``x`` (float32) and ``bits`` (int32)."""
    n = n or len(x)
    x = torch.zeros(n) if x is None else x
    bits = torch.zeros(n, dtype=torch.int32) if bits is None else bits
    out = torch.empty(n, dtype=torch.int32, device=DEVICE)
    _helper[(1,)](x.to(DEVICE), bits.to(DEVICE), out, n, what,
                  enable_fp_fusion=False)  # as the launcher (Note [no FMA] in kernels/tables.py)
    return out.cpu()


def _float_of_bits(bits):
    return torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits],
                        dtype=torch.int32).view(torch.float32)


def test_the_linear_map_rounds_half_to_even():
    """``rint`` of the linear map (docs/math.md, "8-bit": round half to even), as torch.round."""
    y = torch.tensor([0.5, 1.5, 2.5, -2.5, -0.5, 126.5, -126.5, 3.5, 0.49999997, 2.5000002,
                      127.0, -127.0, 0.0, -0.0, 1e-30, -1.4e-45])
    codes = _apply(0, y)
    assert codes.tolist() == torch.round(y).to(torch.int32).tolist()
    assert codes[:8].tolist() == [0, 2, 2, -2, 0, 126, -126, 4]


def test_the_dynamic_map_s_values_are_the_eager_table():
    """``V[mag]`` evaluated per element in the kernels equals the eager backend's table bit for
    bit (float32, one rounding per operation), V[0] = 0 and V[127] = 1 included."""
    got = _apply(1, n=128)
    assert torch.equal(got, lowp._DYNAMIC.view(torch.int32))
    assert got[0] == 0 and got[127] == torch.tensor(1.0).view(torch.int32)


def test_bf16_stores_every_nan_as_0x7fc0():
    """docs/math.md, "bf16": a NaN of any sign and payload (quiet or signalling) is stored as
    0x7fc0, to nearest and stochastically; infinities are kept, and the largest float32 rounds to
    inf as in the cpp backend."""
    nans = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FA00000,
            0xFFA00001]
    others = [0x7F800000, 0xFF800000, 0x3F808000, 0x3F818000, 0x00000000, 0x80000000, 0x7F7FFFFF,
              0x00000001]
    x = _float_of_bits(nans + others)
    ones = torch.full((len(x),), -1, dtype=torch.int32)  # every random bit set
    rne, sto = _apply(2, x), _apply(3, x, ones)
    assert rne[:8].tolist() == sto[:8].tolist() == [0x7FC0] * 8
    assert rne[8:].tolist() == [0x7F80, 0xFF80, 0x3F80, 0x3F82, 0, 0x8000, 0x7F80, 0]
    assert sto[8:].tolist() == [0x7F80, 0xFF80, 0x3F81, 0x3F82, 0, 0x8000, 0x7F80, 1]


# ------------------------------------------------------------------ the maps' corners
# sqrt of the largest float32, correctly rounded (in float64, then rounded: lowp.sqrt_rn)
_S_MAX = torch.tensor(3.4028234663852886e38, dtype=torch.float64).sqrt().float()


def _corners(kind):
    """A grads hook with every corner of the maps (docs/math.md, "8-bit"), in tensors of their
    own so that one tensor's NaN (which the NaN rule spreads over its whole update) hides none of
    the others: gradients so small that ``d`` lies below 2^-64 (a prescaled block); a block of
    zeros; a block whose roots span more than 24 octaves; subnormal gradients; gradients whose
    ``v`` overflows (saturated; LARS: an inf ‖g‖, ratio 0); a NaN of negative sign and another
    payload in the second step and an inf in the third (a block that is not finite, in 8-bit
    and in bf16 state)."""
    def hook(t, grads):
        g = [x.view(-1) for x in grads]  # the grads of _run are contiguous (and float32)
        g[0][:256].mul_(1e-43)  # a block whose 127 / a overflows without the prescale
        g[0][256:].mul_(1e-29)
        g[2][:256] = 0.0
        g[2][256:512].mul_(1e-12)
        g[2][300] = 1.0
        g[2][512:768].mul_(1e-39)
        g[6][7] = 1e30
        g[6][300] = -3e38
        if t == 1:
            g[4][300] = float("nan") if kind == "lars" else -float("nan")
            g[5][1000:1001].view(torch.int32).fill_(0xFFA00001 - (1 << 32))  # -NaN, a payload
        if t == 2:
            g[4][3000] = float("inf")
            g[7][5] = float("inf")
    return hook


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_corners_of_the_maps_match_cpp(kind, fmt):
    """Every byte of the state after three steps of _corners: LAMB's moments do not depend on the
    sums, LARS's buffer takes the cpp run's sums (module docstring); the weights with NaN
    compared as NaN."""
    ref, got = _compare(kind, FORMATS[fmt], {}, steps=3, grads_hook=_corners(kind),
                        nan_weights=True)
    n = len(SHAPES)
    states = ref[-n:] if kind == "lars" else ref[-2 * n:]
    assert any(x.isnan().any() for x in ref[:n]) and not ref[1].isnan().any()
    halves = [_bytes(x).view(torch.int16) for x in states if x.dtype == torch.bfloat16]
    nans = [int(b) for h in halves for b in h[h.view(torch.bfloat16).isnan()]]
    assert (fmt == "8bit") == (not nans)  # bf16 state holds the NaN 0x7fc0 (docs/math.md, "bf16")
    assert set(nans) <= {0x7FC0}
    if fmt == "8bit" and kind == "lamb":
        size = math.prod(SHAPES[2])
        words, codes = lowp.split(states[n + 2], size)  # exp_avg_sq: the roots
        assert words[:1].tolist() == [[0, 0]] and not codes[:256].any()  # a block of zeros
        assert words[1, 1] == 20  # the shift of a block over more than 24 octaves
        words, codes = lowp.split(states[n + 6], math.prod(SHAPES[6]))
        assert words[0, 0] == _S_MAX.view(torch.int32) and codes[7] == 255  # v saturated
        words, codes = lowp.split(states[0], math.prod(SHAPES[0]))  # exp_avg: the directions
        assert (words[:, 0].view(torch.float32) < 2.0 ** -64 / 127).all()  # prescaled blocks
        a = words[0, 0].view(torch.float32) * 127
        assert a < 127 / 3.4028234663852886e38  # where 127 / a overflows
        assert codes[:256].view(torch.int8).abs().max() == 127
        words, codes = lowp.split(states[n + 4], math.prod(SHAPES[4]))  # its NaN block
        assert words[1].tolist() == [0x7FC00000, 0] and (codes[256:512] == 255).all()


@pytest.mark.parametrize("fmt", ["8bit", "bf16"])
def test_pass2_reads_the_directions_alone(fmt):
    """8-bit LAMB's pass 2 takes ``u = c8·d + λ·w`` from ``exp_avg`` alone (docs/math.md,
    "Minimum memory traffic"): ``exp_avg_sq``'s bytes overwritten between the passes (where the
    sums are reduced) change no weight; with bf16 state, whose pass 2 reads ``v``, they do."""
    fmts = FORMATS[fmt]
    gen = torch.Generator().manual_seed(5)

    class Scribble:
        def __init__(self, replay):
            self.replay = replay
            self.reduce_grad_sq = replay.reduce_grad_sq

        def reduce_trust_sums(self, sums, buckets):
            self.replay.reduce_trust_sums(sums, buckets)
            for b in buckets:
                for v in b.exp_avg_sqs:
                    raw = v.view(-1).view(torch.uint8)
                    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))

    record = _Record()
    clean = _run("lamb", "cpp", "cpu", fmts, {}, reducer=record, steps=1)
    scribbled = _run("lamb", "triton", DEVICE, fmts, {}, reducer=Scribble(_Replay(record)),
                     steps=1)
    n = len(SHAPES)
    same = [torch.equal(_bytes(a), _bytes(b)) for a, b in zip(clean, scribbled)]
    assert same[:n] == [fmt == "8bit"] * n  # the params
    assert all(same[n:-n]) and not any(same[-n:])  # step counts and exp_avg; exp_avg_sq


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
    """An inf gradient: its 8-bit block stores the words and codes of a block that is not finite
    (LAMB's direction, LARS's buffer: ``w0 = bits(NaN)``, codes 0; LAMB's root: ``v`` saturated
    at the largest float32, a finite block), the other blocks of the tensor are stored as usual,
    and both backends store the same bytes and give the same NaN positions in the weights (a
    weight's NaN bits are compared as NaN: their payloads are not part of the contract)."""
    def hook(t, grads):
        if t == 1:
            grads[2][600] = float("inf")  # block 2 of the 2500-element tensor

    fmts = FORMATS["mixed"][:3] + ["8bit"] * (len(SHAPES) - 3)
    fmts[2] = "8bit"
    ref, got = _compare(kind, fmts, {}, steps=2, grads_hook=hook, nan_weights=True)
    n = len(SHAPES)
    got_state = got[-n if kind == "lars" else -2 * n:]
    words, codes = lowp.split(got_state[2], 2500)
    nan_word = 0x7FC00000
    assert words[2, 0] == nan_word and (kind == "lamb" or words[2, 1] == 0)
    assert nan_word not in words[[0, 1, 3, 4, 5, 6, 7, 8, 9], 0].tolist()
    assert not codes[512:768].any()
    if kind == "lamb":
        words, codes = lowp.split(got_state[n + 2], 2500)  # the roots: saturated, finite
        assert words[2, 0] == _S_MAX.view(torch.int32) and codes[600] == 255
        assert nan_word not in words[:, 0].tolist()


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
    step_launches, seen = triton_backend.step_launches, []

    def recording(*args, keys=None, **kw):
        seen.append(None if keys is None else keys.tolist())
        return step_launches(*args, keys=keys, **kw)

    runs = [_optimizer_run(DEVICE, False)]
    monkeypatch.setattr(triton_backend, "step_launches", recording)
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
