"""Low-precision optimizer state in the CUDA kernels (docs/math.md "Low-precision state"), run on
the CPU through the SIMT emulation of tests/test_cuda_emulated.py, against the cpp backend bit
for bit.

Each step runs pass 1 of the CUDA kernels (csrc/cuda, emulated) and of the cpp backend
(``torch.ops.fusedopt`` on CPU tensors) on the same inputs; the step counts and every byte of the
states (bf16 words, 8-bit scales and codes) must be equal, and the sums of squares equal to
float32 rounding (each backend reduces in its own order). Pass 2 of both then takes the cpp
backend's sums, so that the trust ratios are the same, and the weights (and the bf16/fp16 params
beside fp32 masters) must be equal bit for bit: every stored bit of the CUDA kernels is that of
the cpp backend, step after step. Every CUDA tensor lies inside a larger buffer whose guard bytes
must come out untouched, some of them misaligned so that both the vector and the element paths
run.
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


def assert_same_state(got: list, want: list, shapes: list, what: str, nan_ok: bool = False):
    for i, (a, b, s) in enumerate(zip(got, want, shapes)):
        if a.dtype == torch.uint8 and nan_ok:  # scales NaN-aware, codes bitwise
            n = math.prod(s)
            sa, ca = lowp.split(a, n)
            sb, cb = lowp.split(b, n)
            assert_same_bits([sa, ca], [sb, cb], f"{what}, tensor {i} (scales, codes)", nan_ok=True)
            pad_a, pad_b = a[4 * lowp.n_blocks(n):lowp.codes_offset(n)], \
                b[4 * lowp.n_blocks(n):lowp.codes_offset(n)]
            assert torch.equal(pad_a, pad_b), f"{what}, tensor {i}: padding"
        else:
            assert_same_bits([a], [b], f"{what}, tensor {i}", nan_ok=nan_ok)


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

    for step in range(case.steps):
        for i, s in enumerate(case.shapes):
            gr = torch.randn(s, generator=gen)
            if case.inf_grad == (step, i) and gr.numel():
                gr.view(-1)[gr.numel() // 2] = math.inf
            grads_c[i].copy_(gr.to(grad_dtype))
            grads[i].copy_(grads_c[i])
        gm_t = None
        if case.clip is not None:
            total = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads_c))
            gm_t = torch.tensor(min(1.0, case.clip / total), dtype=torch.float32)
        fi = None if case.found_inf is None else case.found_inf[step]
        fi_t = None if fi is None else torch.tensor(fi, dtype=torch.float32)
        ptr = (lambda t: None if t is None else t.data_ptr())
        sc1 = DeviceScalarsC(ptr(gm_t), ptr(fi_t), None)
        sc2 = DeviceScalarsC(ptr(gm_t), ptr(fi_t), ptr(lr_t))
        nan_ok = case.inf_grad is not None and step >= case.inf_grad[0]

        sums = emu.run_pass(f"{case.kind}_pass1", b1, hyper_c, sc1)
        if lamb:
            sums_c = OPS.lamb_pass1(weights_c, grads_c, s1_c, s2_c, steps_c, hyper_t, gm_t, fi_t,
                                    keys_t)
        else:
            sums_c = OPS.lars_pass1(weights_c, grads_c, steps_c, hyper_t, gm_t, fi_t)
        assert_same_bits(steps, steps_c, f"step counts after pass 1 of step {step}")
        if lamb:
            assert_same_state(s1, s1_c, case.shapes, f"exp_avg after step {step}", nan_ok)
            assert_same_state(s2, s2_c, case.shapes, f"exp_avg_sq after step {step}", nan_ok)
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


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_a_block_that_is_not_finite(emu, kind):
    """An inf gradient: its 8-bit block stores the scale NaN and codes 0, its bf16 moments inf
    (v) as on the cpp backend; the NaN rule then takes the tensor's update (compared NaN for
    NaN: a NaN's payload is the hardware's)."""
    hyper = {"lamb": {}, "lars": dict(weight_decay=1e-4)}[kind]
    out = run_lowp(emu, LowpCase(kind, SMALL, SMALL_FORMATS, hyper, inf_grad=(1, 0)))
    for state in (out["s1"][0], *([out["s2"][0]] if kind == "lamb" else [])):
        scales, codes = lowp.split(state, SMALL[0][0])
        bad = scales.isnan().nonzero().reshape(-1).tolist()
        # LAMB: the block of the inf; LARS: every block (its trust ratio is NaN from step 2 on)
        assert len(bad) == (1 if kind == "lamb" else len(scales)), bad
        for blk in bad:
            assert not codes[256 * blk:256 * (blk + 1)].any()


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
