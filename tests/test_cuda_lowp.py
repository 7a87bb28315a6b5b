"""Low-precision optimizer state in the CUDA kernels (docs/math.md "Low-precision state"), run on
the CPU through the SIMT emulation of tests/test_cuda_emulated.py, against the cpp backend bit
for bit.

Each step runs pass 1 of the CUDA kernels (csrc/cuda, emulated) and of the cpp backend
(``torch.ops.fusedopt`` on CPU tensors) on the same inputs; the step counts and every byte of the
states (bf16 words; 8-bit block words, padding and codes) must be equal, and the sums of squares
equal to float32 rounding (each backend reduces in its own order). Pass 2 of both then takes the
cpp backend's sums, so that the trust ratios are the same, and the weights (and the bf16/fp16
params beside fp32 masters) and LARS's buffers must be equal bit for bit: every stored bit of the
CUDA kernels is that of the cpp backend, step after step. A NaN in bf16 or 8-bit state is one
pattern on every backend (docs/math.md, "Low-precision state"), so those states are compared
byte for byte even where the gradients were not finite; only float32 values (weights, params,
full state) are then compared NaN for NaN. Every CUDA tensor lies inside a larger buffer whose
guard bytes must come out untouched, some of them misaligned so that both the vector and the
element paths run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

import fusedopt._C  # noqa: F401  (the operators of the cpp backend)
from fusedopt import _hyper, lowp
from test_cuda_emulated import (  # noqa: F401  (build, emu: fixtures)
    CXX, FORWARD, NOT_SUPPORTED, RANDOM, REVERSE, DeviceScalarsC, KernelError, Lists, build, emu,
    lamb_hyper, lars_hyper,
)

pytestmark = pytest.mark.skipif(
    CXX is None, reason="no host C++ compiler (g++ or c++ on PATH): the CUDA sources cannot be "
    "built for the SIMT emulation")

OPS = torch.ops.fusedopt
CODE = {"full": 0, "bf16": 1, "8bit": 2}
CHUNK = 65536
GUARD = 0xA5


class ByteArena:
    """Each tensor is a view into a larger byte buffer, with guard bytes before and after it,
    its data pointer ``misalign`` bytes past a 64-byte boundary."""

    def __init__(self):
        self.buffers: list[tuple[torch.Tensor, int, int]] = []

    def place(self, src: torch.Tensor, misalign: int = 0) -> torch.Tensor:
        nbytes = src.numel() * src.element_size()
        lead = 64 + misalign
        raw = torch.full((lead + nbytes + 128,), GUARD, dtype=torch.uint8)
        shift = (-raw.data_ptr()) % 64
        buf = raw[shift:shift + lead + nbytes + 64]
        view = buf[lead:lead + nbytes].view(src.dtype).view(src.shape)
        view.copy_(src)
        if nbytes:
            assert view.data_ptr() % 64 == misalign
        self.buffers.append((buf, lead, nbytes))
        return view

    def check_guards(self):
        for buf, lead, n in self.buffers:
            outside = torch.cat([buf[:lead], buf[lead + n:]])
            assert bool((outside == GUARD).all()), f"a kernel wrote outside a tensor of {n} bytes"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1).to(torch.uint8)


def assert_same_bits(got: list, want: list, what: str, nan_ok: bool = False):
    """Equal bytes; with nan_ok, float32 words that are NaN on both sides count as equal (an
    arithmetic NaN's payload depends on which operand the hardware propagates)."""
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}, tensor {i}: {a.dtype} {b.dtype}"
        if nan_ok and a.dtype in (torch.float32, torch.bfloat16, torch.float16):
            nan = a.isnan() & b.isnan()
            assert torch.equal(a.isnan(), b.isnan()), f"{what}, tensor {i}: NaNs differ"
            a, b = a[~nan], b[~nan]
        ab, bb = _bytes(a), _bytes(b)
        if not torch.equal(ab, bb):
            k = int((ab != bb).nonzero()[0]) if ab.numel() == bb.numel() else -1
            raise AssertionError(f"{what}, tensor {i}: differ bitwise (first byte {k} of "
                                 f"{ab.numel()})")


def _packed_part(n: int, byte: int) -> str:
    """Where byte ``byte`` of a packed 8-bit tensor of ``n`` elements lies."""
    if byte < 8 * lowp.n_blocks(n):
        return f"word {byte // 4 % 2} of block {byte // 8}"
    if byte < lowp.codes_offset(n):
        return "the padding after the words"
    return f"the code of element {byte - lowp.codes_offset(n)}"


def assert_same_state(got: list, want: list, shapes: list, what: str, nan_ok: bool = False):
    """bf16 and 8-bit state byte for byte (whatever ``nan_ok``: their NaNs are one pattern),
    float32 state NaN for NaN with ``nan_ok``."""
    for i, (a, b, s) in enumerate(zip(got, want, shapes)):
        if a.dtype == torch.uint8 and not torch.equal(a, b):
            assert a.shape == b.shape, f"{what}, tensor {i}: {a.shape} {b.shape}"
            k = int((a != b).nonzero()[0])
            raise AssertionError(f"{what}, tensor {i}: differ bitwise in "
                                 f"{_packed_part(math.prod(s), k)} (byte {k} of {a.numel()}: "
                                 f"{int(a[k]):#04x}, cpp {int(b[k]):#04x})")
        low = a.dtype in (torch.uint8, torch.bfloat16)
        assert_same_bits([a], [b], f"{what}, tensor {i}", nan_ok=nan_ok and not low)


@dataclass
class LowpCase:
    kind: str                    # "lamb" or "lars"
    shapes: list
    formats: list                # per tensor: "full", "bf16", "8bit"
    hyper: dict = field(default_factory=dict)
    steps: int = 3
    seed: int = 0
    keys: list | None = None     # random-bit keys (LAMB), None: the index
    dtype: torch.dtype = torch.float32       # params
    grad_dtype: torch.dtype | None = None
    masters: bool = False        # fp32 masters beside bf16/fp16 params
    clip: float | None = None    # global clipping: grad_mult = min(1, clip / ‖g‖) per step
    found_inf: list | None = None  # per step
    inf_grad: tuple | None = None  # (step, tensor): an inf in that tensor's grad at that step
    bad_value: float = math.inf    # what inf_grad puts there (inf or NaN)
    # (step, tensor) -> fn(grad): rewrites that grad in place (special values: SPECIAL_GRADS)
    grad_fns: dict = field(default_factory=dict)
    # some CUDA tensors not 16 (8-bit codes: not 8) byte aligned; a list ("param", "master",
    # "grad", "s1", "s2"): tensor 1 misaligned in that list only
    misalign: bool | str = True
    lr_tensor: bool = False


def _mis(i: int, role: str, t: torch.Tensor, case: LowpCase) -> int:
    """Bytes past a 64-byte boundary: tensor 1, 4, ... misaligned in every list, tensor 2, 5, ...
    in its states only (their elements by element, w and g by 16-byte vectors), others aligned;
    with a list named by ``case.misalign``, tensor 1 in that list only. 8-bit state: 4 bytes (a
    4-byte boundary, not 8: its codes go byte by byte)."""
    if isinstance(case.misalign, str):
        hit = i == 1 and role == case.misalign
    else:
        hit = case.misalign and i % 3 == 1 or i % 3 == 2 and role in ("s1", "s2")
    if not hit or not case.misalign:
        return 0
    return 4 if t.dtype == torch.uint8 else t.element_size()


def run_lowp(emu, case: LowpCase):
    """``case.steps`` steps on both backends; checks every step and returns the CUDA tensors."""
    lamb = case.kind == "lamb"
    gen = torch.Generator().manual_seed(case.seed)
    n = len(case.shapes)
    grad_dtype = case.grad_dtype or case.dtype
    init = [torch.randn(s, generator=gen) for s in case.shapes]
    params_c = [t.to(case.dtype) for t in init]
    masters_c = [p.float() for p in params_c] if case.masters else None
    weights_c = masters_c if case.masters else params_c
    like = [torch.empty(s) for s in case.shapes]
    s1_c = [lowp.zeros(x, f) for x, f in zip(like, case.formats)]
    s2_c = [lowp.zeros(x, f) for x, f in zip(like, case.formats)] if lamb else None
    steps_c = [torch.zeros(()) for _ in range(n)]
    grads_c = [torch.zeros(s, dtype=grad_dtype) for s in case.shapes]

    arena = ByteArena()

    def place(t, i, role):
        return arena.place(t.clone(), _mis(i, role, t, case))

    params = [place(p, i, "param") for i, p in enumerate(params_c)]
    masters = [place(m, i, "master") for i, m in enumerate(masters_c)] if case.masters else None
    weights = masters if case.masters else params
    grads = [place(g, i, "grad") for i, g in enumerate(grads_c)]
    s1 = [place(x, i, "s1") for i, x in enumerate(s1_c)]
    s2 = [place(x, i, "s2") for i, x in enumerate(s2_c)] if lamb else None
    steps = [arena.place(torch.zeros(())) for _ in range(n)]
    fmt = [CODE[f] for f in case.formats]
    lowp_params = params if case.masters else None
    if lamb:
        b1 = Lists(weights, grads, s1, s2, None, steps, grad_dtype, fmt, case.keys)
        b2 = Lists(weights, None, s1, s2, lowp_params, steps, None, fmt)
    else:
        b1 = Lists(weights, grads, None, None, None, steps, grad_dtype)
        b2 = Lists(weights, grads, s1, None, lowp_params, steps, grad_dtype, fmt)

    lr = 0.05 if case.kind == "lamb" else 0.1
    defaults = _hyper.LAMB_DEFAULTS if lamb else _hyper.LARS_DEFAULTS
    group = {**defaults, **case.hyper, "lr": lr}
    h = (_hyper.lamb_hyper if lamb else _hyper.lars_hyper)(group)
    hyper_t = _hyper.encode(h)
    hyper_c = (lamb_hyper if lamb else lars_hyper)(case.hyper, 7.0 if case.lr_tensor else lr)
    lr_t = torch.tensor(lr, dtype=torch.float64) if case.lr_tensor else None
    keys_t = torch.tensor(case.keys, dtype=torch.int64) if case.keys is not None else None
    lowp_params_c = params_c if case.masters else []

    nonfinite = False  # a grad so far held inf or NaN (then so may the float32 results)
    for step in range(case.steps):
        for i, s in enumerate(case.shapes):
            gr = torch.randn(s, generator=gen)
            if case.inf_grad == (step, i) and gr.numel():
                gr.view(-1)[gr.numel() // 2] = case.bad_value
            if (step, i) in case.grad_fns:
                case.grad_fns[step, i](gr.view(-1))
            grads_c[i].copy_(gr.to(grad_dtype))
            grads[i].copy_(grads_c[i])
            nonfinite = nonfinite or not bool(grads_c[i].isfinite().all())
        gm_t = None
        if case.clip is not None:
            total = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads_c))
            gm_t = torch.tensor(min(1.0, case.clip / total), dtype=torch.float32)
        fi = None if case.found_inf is None else case.found_inf[step]
        fi_t = None if fi is None else torch.tensor(fi, dtype=torch.float32)
        ptr = (lambda t: None if t is None else t.data_ptr())
        sc1 = DeviceScalarsC(ptr(gm_t), ptr(fi_t), None)
        sc2 = DeviceScalarsC(ptr(gm_t), ptr(fi_t), ptr(lr_t))
        nan_ok = nonfinite

        sums = emu.run_pass(f"{case.kind}_pass1", b1, hyper_c, sc1)
        if lamb:
            sums_c = OPS.lamb_pass1(weights_c, grads_c, s1_c, s2_c, steps_c, hyper_t, gm_t, fi_t,
                                    keys_t)
        else:
            sums_c = OPS.lars_pass1(weights_c, grads_c, steps_c, hyper_t, gm_t, fi_t)
        assert_same_bits(steps, steps_c, f"step counts after pass 1 of step {step}")
        if lamb:  # exp_avg_sq first: the random bits round it, and exp_avg is made from it
            assert_same_state(s2, s2_c, case.shapes, f"exp_avg_sq after step {step}", nan_ok)
            assert_same_state(s1, s1_c, case.shapes, f"exp_avg after step {step}", nan_ok)
        if fi:
            assert torch.equal(sums, torch.zeros_like(sums))
        else:
            torch.testing.assert_close(sums, sums_c, rtol=2e-5, atol=1e-30, equal_nan=True,
                                       msg=lambda m: f"pass-1 sums of step {step}: {m}")

        emu.run_pass(f"{case.kind}_pass2", b2, hyper_c, sc2, sums_c.clone())
        if lamb:
            OPS.lamb_pass2(weights_c, lowp_params_c, s1_c, s2_c, steps_c, sums_c, hyper_t, lr_t,
                           fi_t)
        else:
            OPS.lars_pass2(weights_c, lowp_params_c, grads_c, s1_c, steps_c, sums_c, hyper_t,
                           lr_t, gm_t, fi_t)
            assert_same_state(s1, s1_c, case.shapes, f"momentum_buffer after step {step}",
                              nan_ok)
        assert_same_bits(weights, weights_c, f"weights after step {step}", nan_ok)
        if case.masters:
            assert_same_bits(params, params_c, f"params after step {step}", nan_ok)
        assert_same_bits(grads, grads_c, "grads (read-only)")
    arena.check_guards()
    done = sum(1 for k in range(case.steps) if not (case.found_inf and case.found_inf[k]))
    assert all(float(t) == done for t in steps)
    return dict(weights=weights, params=params, s1=s1, s2=s2, steps=steps)


# sizes around the 8-bit blocks (256) and the chunks (65536); a 0-size tensor; a 2-D tensor
SHAPES = [(1000,), (257,), (0,), (33, 40), (CHUNK + 300,), (5,), (256,), (3000,)]
FORMATS = ["8bit", "bf16", "8bit", "8bit", "8bit", "bf16", "full", "8bit"]
# some with a high half: the first element of a run of a tensor (docs/math.md, "Random bits")
KEYS = [7 | 5 << 32, 0, 3 | -1 << 32, 11, 2 | 1234567 << 32, 40, 9, 1]


def _formats(precision: str) -> list:
    return FORMATS if precision == "mixed" else [precision] * len(SHAPES)


@pytest.mark.parametrize("precision", ["bf16", "8bit", "mixed"])
def test_lamb_equals_cpp_bit_for_bit(emu, precision):
    run_lowp(emu, LowpCase("lamb", SHAPES, _formats(precision), keys=KEYS))


@pytest.mark.parametrize("precision", ["bf16", "8bit", "mixed"])
def test_lars_equals_cpp_bit_for_bit(emu, precision):
    run_lowp(emu, LowpCase("lars", SHAPES, _formats(precision), dict(weight_decay=1e-4)))


SMALL = [(700,), (257,), (5,), (2, 300), (0,), (513,)]
SMALL_FORMATS = ["8bit", "bf16", "8bit", "bf16", "8bit", "full"]

LAMB_OPTIONS = {
    "decoupled": dict(decoupled_weight_decay=True, weight_decay=0.1),
    "bounded_no_bias_correction": dict(trust_ratio_bounds=(0.5, 2.0), bias_correction=False,
                                       weight_decay=0.01),
    "no_adapt_no_averaging": dict(adapt=False, grad_averaging=False),
}
LARS_OPTIONS = {
    "sgd_form_dampening": dict(lr_in_momentum=False, dampening=0.3, weight_decay=1e-4),
    "nesterov": dict(nesterov=True, weight_decay=1e-4),
    "sgd_nesterov": dict(nesterov=True, lr_in_momentum=False, weight_decay=1e-4),
    "combined_clip": dict(denominator="combined", trust_clip=True, trust_coefficient=1.0,
                          weight_decay=1e-2),
}


@pytest.mark.parametrize("name", list(LAMB_OPTIONS))
def test_lamb_options(emu, name):
    run_lowp(emu, LowpCase("lamb", SMALL, SMALL_FORMATS, LAMB_OPTIONS[name], seed=1))


@pytest.mark.parametrize("name", list(LARS_OPTIONS))
def test_lars_options(emu, name):
    run_lowp(emu, LowpCase("lars", SMALL, SMALL_FORMATS, LARS_OPTIONS[name], seed=2))


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_global_clipping_and_a_tensor_lr(emu, kind):
    """grad_mult = min(1, max_grad_norm / ‖g‖) read by the kernels, and an lr tensor."""
    hyper = {"lamb": {}, "lars": dict(weight_decay=1e-4)}[kind]
    run_lowp(emu, LowpCase(kind, SMALL, SMALL_FORMATS, hyper, clip=1.0, lr_tensor=True,
                           keys=[3, 1, 4, 1, 5, 9] if kind == "lamb" else None))


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_found_inf_changes_nothing(emu, kind):
    """A nonzero found_inf is a no-op of both passes (states, steps, weights), on both backends
    alike; the steps after it continue bit for bit."""
    hyper = {"lamb": {}, "lars": dict(weight_decay=1e-4)}[kind]
    case = LowpCase(kind, SMALL, SMALL_FORMATS, hyper, steps=4, found_inf=[0.0, 1.0, 0.0, math.inf])
    out = run_lowp(emu, case)
    assert all(float(t) == 2 for t in out["steps"])


@pytest.mark.parametrize("masters", [False, True], ids=["bf16_params", "bf16_masters"])
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_bf16_params(emu, kind, masters):
    """bf16 params (float32 math), alone or beside fp32 masters that the kernels update and round
    to the params; fp32 grads for the masters, bf16 grads without."""
    hyper = {"lamb": {}, "lars": dict(weight_decay=1e-4)}[kind]
    run_lowp(emu, LowpCase(kind, SMALL, SMALL_FORMATS, hyper, dtype=torch.bfloat16,
                           masters=masters,
                           grad_dtype=torch.float32 if masters else torch.bfloat16))


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_fp16_masters(emu, kind):
    hyper = {"lamb": {}, "lars": dict(weight_decay=1e-4)}[kind]
    run_lowp(emu, LowpCase(kind, SMALL, SMALL_FORMATS, hyper, dtype=torch.float16, masters=True,
                           grad_dtype=torch.float16, steps=2))


NAN_WORD = 0x7FC00000  # w0 of an 8-bit block that is not finite (docs/math.md, "8-bit")


def _words_and_codes(state: torch.Tensor, n: int) -> tuple[list, torch.Tensor]:
    """The block words of a packed 8-bit tensor as unsigned 32-bit values (``[(w0, w1)]``) and
    its codes as integers."""
    words, codes = lowp.split(state, n)
    return [(int(a) & 0xFFFFFFFF, int(b) & 0xFFFFFFFF) for a, b in words.tolist()], \
        codes.to(torch.int64)


def _f32(word: int) -> float:
    return float(torch.tensor([word], dtype=torch.int64).to(torch.int32).view(torch.float32))


@pytest.mark.parametrize("bad", [math.inf, math.nan], ids=["inf", "nan"])
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_a_block_that_is_not_finite(emu, kind, bad):
    """An inf or NaN gradient in one element of an 8-bit tensor at step 1 (of 0, 1, 2), the same
    bytes as the cpp backend: LAMB's direction block of it stores w0 = NaN and codes 0 from then
    on; its root block stores (NaN, 0) and codes 255 for a NaN gradient, while an inf one
    saturates v at the largest float32 (a finite root, the block's largest: code 255 under a
    finite T). LARS: every block of the buffer w0 = NaN and codes 0 (its trust ratio is NaN from
    step 2 on). The NaN rule then takes the tensor's update (compared NaN for NaN: a NaN's
    payload is the hardware's)."""
    hyper = {"lamb": {}, "lars": dict(weight_decay=1e-4)}[kind]
    n = SMALL[0][0]

    def spoil(g):  # the bf16 tensor 1 too: its NaNs are stored as 0x7fc0 (docs/math.md, "bf16")
        g[100] = bad

    out = run_lowp(emu, LowpCase(kind, SMALL, SMALL_FORMATS, hyper, inf_grad=(1, 0),
                                 bad_value=bad, grad_fns={(1, 1): spoil}))
    for state in (out["s1"][1], *([out["s2"][1]] if kind == "lamb" else [])):
        h = state.view(torch.int16).to(torch.int64) & 0xFFFF
        nan = state.isnan()
        assert bool(nan.any()) == (kind == "lars" or math.isnan(bad))
        assert bool((h[nan] == 0x7FC0).all()), h[nan].unique()
        if kind == "lamb" and not math.isnan(bad):
            assert bool(state.isinf().any())  # inf moments are kept
    blk = (n // 2) // 256  # the block of the bad element
    words, codes = _words_and_codes(out["s1"][0], n)
    nan_blocks = [q for q, (w0, _) in enumerate(words) if w0 == NAN_WORD]
    assert nan_blocks == ([blk] if kind == "lamb" else list(range(len(words)))), words
    for q in nan_blocks:
        assert not codes[256 * q:256 * (q + 1)].any()
        assert words[q][1] == (0 if kind == "lars" else words[q][1])
    if kind == "lars":
        assert all(w1 == 0 for _, w1 in words)
        return
    words, codes = _words_and_codes(out["s2"][0], n)
    mine = codes[256 * blk:256 * (blk + 1)]
    if math.isnan(bad):
        assert words[blk] == (NAN_WORD, 0) and bool((mine == 255).all()), words[blk]
        assert all(w0 < 0x7F800000 for q, (w0, _) in enumerate(words) if q != blk)
    else:
        assert all(w0 < 0x7F800000 for w0, _ in words), words
        assert int(codes[n // 2]) == 255 and _f32(words[blk][0]) > 1.8e19, words[blk]


def _zeros(g):
    g.zero_()


def _patterns(g, huge=1e30):
    """Blocks of a 2000-element grad (8 blocks) with the values the maps treat apart: zeros,
    zeros among nonzero values, tiny and subnormal values (a direction or buffer block below
    2^-64: prescaled), huge ones (LAMB: v over the largest float32, saturated; LARS takes 1e10,
    which keeps ‖g‖² finite), a block spanning 60 octaves (the root map's 24-octave clamp and
    shift 20; the dynamic map's magnitudes below 8^-7 of the largest), one value far above the
    others of its block (the others' codes low)."""
    b = g.view(-1)[:2000]
    b[:256] = 0.0                                               # a block of zeros
    b[256:512:2] = 0.0                                          # zeros among others
    b[512:768] *= 1e-30                                         # tiny: v underflows to 0
    b[768:1024] *= 1e-41                                        # subnormal
    b[1024:1100] *= huge
    k = torch.arange(256, dtype=torch.float64)
    b[1280:1536] = (torch.sign(b[1280:1536]).double() * 2.0 ** (-50 + 60 * k / 255)).float()
    b[1536] = 1e6                                               # an outlier
    b[1792:2000] = b[1792:2000].sign() * 3.0                    # equal magnitudes


SPECIAL_SHAPES = [(2000,), (700,), (600,), (300,), (513,), (5,)]
SPECIAL_FORMATS = ["8bit", "8bit", "bf16", "bf16", "8bit", "full"]
# every step's grad of tensor 0 holds the patterns; tensor 1 is zero at step 1 (its blocks of
# zeros after nonzero ones); tensor 4 is zero from step 1 on (all of its moments decay)
SPECIAL_GRADS = {**{(s, 0): _patterns for s in range(4)}, (1, 1): _zeros, (1, 4): _zeros,
                 (2, 4): _zeros, (3, 4): _zeros}
SPECIAL_GRADS_LARS = {**SPECIAL_GRADS,
                      **{(s, 0): (lambda g: _patterns(g, huge=1e10)) for s in range(4)}}


@pytest.mark.parametrize("kind,hyper", [
    ("lamb", {}), ("lamb", dict(bias_correction=False, decoupled_weight_decay=True,
                                weight_decay=0.1)),
    ("lars", {}), ("lars", dict(lr_in_momentum=False, weight_decay=1e-4))],
    ids=["lamb", "lamb_no_bias_correction_decoupled", "lars", "lars_sgd_form"])
def test_special_gradients(emu, kind, hyper):
    """Zero, tiny, subnormal, huge and widely spread gradients in the 8-bit and bf16 tensors of
    one launch, over four steps: every byte as on the cpp backend, and the words show that the
    maps' special cases ran (a block of zeros: words 0; the prescaled tiny blocks; the saturated
    v; the root map's largest shift)."""
    fns = SPECIAL_GRADS if kind == "lamb" else SPECIAL_GRADS_LARS
    out = run_lowp(emu, LowpCase(kind, SPECIAL_SHAPES, SPECIAL_FORMATS, hyper, steps=4,
                                 grad_fns=fns, keys=[5, 6, 7, 8, 9, 10]))
    n = SPECIAL_SHAPES[0][0]
    if kind == "lars":
        words, codes = _words_and_codes(out["s1"][0], n)
        if not hyper.get("weight_decay"):  # lambda*w fills the blocks of zero or tiny grads
            assert words[0] == (0, 0), words[0]  # a block of zeros (its codes: see below)
            assert not lowp.read(out["s1"][0], torch.Size([n]), "momentum_buffer")[:256].any()
            assert 0 < _f32(words[2][0]) < 2.0 ** -64, words[2]  # the tiny block, prescaled
        assert bool((codes[1280:1536] == 0).any())  # below 8^-7 of the block's largest
        return
    dw, dc = _words_and_codes(out["s1"][0], n)
    rw, rc = _words_and_codes(out["s2"][0], n)
    assert rw[0] == (0, 0) and dw[0][0] == 0 and not rc[:256].any() and not dc[:256].any()
    assert bool((rc[256:512:2] == 0).all()) and bool((rc[257:512:2] != 0).all())
    assert 0 < _f32(dw[3][0]) < 2.0 ** -64, dw[3]  # the subnormal block's d, prescaled
    assert _f32(rw[4][0]) > 1.8e19  # √v of the saturated v
    assert rw[5][1] == 20, rw[5]  # 60 octaves: the clamp to 24, shift 20
    words, codes = _words_and_codes(out["s2"][4], 513)
    assert all(w0 > 0 for w0, _ in words)  # decaying, not yet 0


def test_a_lars_block_of_zeros_stores_codes_0(emu):
    """docs/math.md: "A block of zeros stores w0 = 0 and codes 0. All-zero state (every byte 0)
    is the state of a fresh param": a LARS step with zero grads and no weight decay leaves an
    8-bit buffer of zeros every byte 0."""
    out = run_lowp(emu, LowpCase("lars", [(700,)], ["8bit"], steps=1, grad_fns={(0, 0): _zeros}))
    assert not out["s1"][0].any(), _words_and_codes(out["s1"][0], 700)[1].unique()


def test_many_tensors_split_the_launches(emu):
    """More tensors than a table with the state row holds: each pass splits into launches."""
    shapes = [(1 + (37 * i) % 600,) for i in range(70)]
    formats = [("8bit", "bf16", "full")[i % 3] for i in range(70)]
    assert emu.lib.simt_table_capacity(6) < 70
    emu.reset_stats()
    run_lowp(emu, LowpCase("lamb", shapes, formats, steps=2, keys=list(range(100, 170))))
    chunk = [g for name, g, _ in emu.launches() if "chunk_kernel" in name]
    assert len(chunk) >= 2 * 2 * 2


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_schedules_and_alignment_do_not_change_a_bit(emu, kind):
    """The 8-bit blocks' reductions (shuffles, shared memory, a barrier per round) and their
    scales' writes give the same bits whatever order threads and blocks run in, aligned or not
    (a race would show: test_cuda_emulated.test_resume_order_exposes_a_shared_memory_race)."""
    hyper = {"lamb": {}, "lars": dict(weight_decay=1e-4)}[kind]
    shapes = [(CHUNK + 700,), (700,), (5,)]
    formats = ["8bit", "8bit", "bf16"]
    results = []
    try:
        for threads, blocks, seed, mis in ((FORWARD, FORWARD, 0, False),
                                           (REVERSE, REVERSE, 0, True), (RANDOM, RANDOM, 1, True)):
            emu.schedule(threads, blocks, seed)
            out = run_lowp(emu, LowpCase(kind, shapes, formats, hyper, steps=2, misalign=mis))
            results.append([t.clone() for k in ("weights", "s1", "s2") for t in (out[k] or [])])
    finally:
        emu.schedule()
    for other in results[1:]:
        assert_same_bits(other, results[0], "outputs under another schedule")


@pytest.mark.parametrize("role,masters,fmt", [
    ("param", False, "8bit"), ("param", True, "8bit"), ("master", True, "8bit"),
    ("grad", False, "8bit"), ("s1", False, "bf16"), ("s1", False, "8bit"), ("s2", False, "bf16"),
    ("s2", False, "8bit")], ids=lambda x: str(x))
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_one_list_misaligned(emu, kind, role, masters, fmt):
    """One list of one tensor misaligned, the others aligned: the kernels' alignment checks must
    send that tensor down the element path (a vector access through its pointer is a launch
    failure in the emulation), and the bits stay those of the cpp backend."""
    if kind == "lars" and role == "s2":
        pytest.skip("LARS has one state list")
    hyper = {"lamb": {}, "lars": dict(weight_decay=1e-4)}[kind]
    run_lowp(emu, LowpCase(kind, [(CHUNK + 700,), (CHUNK + 300,), (5,)], ["8bit", fmt, "bf16"],
                           hyper, dtype=torch.bfloat16 if masters else torch.float32,
                           masters=masters, grad_dtype=torch.float32, steps=2, misalign=role))


def test_float64_weights_with_low_precision_state_are_refused(emu):
    w = [torch.zeros(300, dtype=torch.float64)]
    m = [lowp.zeros(torch.empty(300), "8bit")]
    steps = [torch.zeros(())]
    sums = torch.zeros(1, 2, dtype=torch.float64)
    b = Lists(w, w, m, m, None, steps, torch.float64, [2])
    with pytest.raises(KernelError, match=f"error {NOT_SUPPORTED}"):
        emu.run_pass("lamb_pass1", b, lamb_hyper({}, 0.1), DeviceScalarsC(None, None, None))
    b = Lists(w, None, m, m, None, steps, None, [2])
    with pytest.raises(KernelError, match=f"error {NOT_SUPPORTED}"):
        emu.run_pass("lamb_pass2", b, lamb_hyper({}, 0.1), DeviceScalarsC(None, None, None), sums)
    b = Lists(w, w, m, None, None, steps, torch.float64, [2])
    with pytest.raises(KernelError, match=f"error {NOT_SUPPORTED}"):
        emu.run_pass("lars_pass2", b, lars_hyper({}, 0.1), DeviceScalarsC(None, None, None), sums)


def test_the_comparison_is_not_vacuous(emu):
    """A wrong key (LAMB's random bits) changes the stored v: the bitwise checks would fail."""
    with pytest.raises(AssertionError, match="exp_avg_sq"):
        case = LowpCase("lamb", [(700,)], ["8bit"], keys=[1], steps=1)
        # the CUDA side reads keys from the Lists, the cpp side from keys_t: make them differ
        run_lowp(_WrongKeys(emu), case)


class _WrongKeys:
    """The emulator with the keys of every LAMB pass 1 shifted by one."""

    def __init__(self, emu):
        self._emu = emu

    def run_pass(self, name, b, *args, **kw):
        if name == "lamb_pass1" and b.keys is not None:
            b = Lists(b.weights, b.grads, b.state1, b.state2, b.params, b.steps, b.grad_dtype,
                      b.formats, [k + 1 for k in b.keys])
        return self._emu.run_pass(name, b, *args, **kw)
