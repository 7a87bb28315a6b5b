"""Same numbers as commit 990dfdf (and, for eager, 89780ab): every case of tests/golden.py (100
steps of each LAMB and LARS option set) run with the current code must give bit-identical params
and optimizer state to the recording tests/data/golden_131ab63.pt (the recording of 990dfdf for
cpp and Triton and of 89780ab for eager, which made eager round as docs/math.md says, except the
two float64 cases that clip: 131ab63 made the CPU float64 roots correctly rounded; tests/golden.py
says how and why).

Every case runs on eager and cpp. Triton runs under its interpreter at 50-130 ms a step, so it
runs the covering subset ``TRITON_CASES`` only (the recording has every case on every backend;
``python tests/golden.py --compare`` or a local edit of ``TRITON_CASES`` checks the rest): together
they use every LAMB and LARS flag of the kernels (bias correction, grad averaging, bounds, adapt
on/off, decoupled decay, combined denominator, trust clip, Nesterov, lr in momentum with
dampening), float32, bfloat16 with and without master weights and float64 params, a tensor lr, a
float and a tensor lr schedule, clipping, skipped non-finite steps, two param groups and
tensors of several chunks.

Threads: the tests run with ``torch.set_num_threads(1)`` (the recording, made with 2 threads, was
checked to be identical with 1): with 2 threads, while another process keeps one of this
machine's 2 cores busy, the 33001-element cases took 5-17 s each instead of 0.1 s (the OpenMP
regions wait for a descheduled thread). ``test_same_numbers_two_threads`` runs the cpp case
that forks an OpenMP region with 2 threads (skipped when fewer than 2 are available; the
thread-count invariance itself is tests/test_cpp.py's business; the recording has no
difference between 1 and 2 threads).

Float64 on Triton is LARS's case: LAMB's float64 bias correction there is ``exp2(t·log2 β)``
(docs/triton_kernels.md, "Bias correction"), whose last bits are the math library's, under the
interpreter numpy's, which picks other implementations on CPUs with AVX-512, so a recording of
``lamb_float64`` holds only on CPUs like the one that made it (docs/triton_kernels.md gives the
differences seen). The float32 cases round those factors to float32, which hides the last bits
on every recorded step.

A backend that cannot run here is skipped with the reason. An intended change of the numbers
needs a new recording (and a new name for it), never an edit of this test.
"""
import os

import pytest
import torch

import golden

# numpy's warnings from the Triton interpreter, for lanes that masks discard (990dfdf has them too)
pytestmark = pytest.mark.filterwarnings(
    "ignore:(invalid value|divide by zero) encountered:RuntimeWarning")

RECORDING = os.path.join(os.path.dirname(__file__), "data", "golden_131ab63.pt")

TRITON_CASES = (
    "lamb_mix",  # no bias correction / grad averaging, eps, betas, open bounds, tensor lr, clip,
    #              skip (nan), 2 chunks
    "lamb_bf16_groups_mix",  # bf16 + masters, 2 groups (adapt off), decoupled, bounds, schedule,
    #                          skip (inf)
    "lars_float64",  # float64 (LARS: no bias correction, see above), clip
    "lars_mix",  # lr_in_momentum=False + dampening, trust coefficient, eps, tensor lr, skip, 2 chunks
    "lars_groups_combined_clip_schedule",  # 2 groups (adapt off), combined, trust clip, clip,
    #                                        tensor lr schedule
    "lars_bf16_no_master_nesterov",  # bf16 without masters, Nesterov
)

PARAMS = [pytest.param(name, backend, id=f"{name}-{backend}")
          for name in golden.CASES for backend in golden.BACKENDS
          if backend != "triton" or name in TRITON_CASES]


@pytest.fixture(scope="module")
def recording():
    if not os.path.exists(RECORDING):
        pytest.fail(f"{RECORDING} is missing (see tests/golden.py for how it was made)")
    return torch.load(RECORDING, weights_only=True)


_unavailable: dict[str, str | None] = {}


@pytest.fixture(autouse=True)
def one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _skip_unless_available(backend: str) -> None:
    if backend not in _unavailable:
        _unavailable[backend] = golden.backend_unavailable(backend)
    if _unavailable[backend] is not None:
        pytest.skip(f"backend {backend!r} is not available: {_unavailable[backend]}")


def test_recording_has_every_case(recording):
    cases = set(recording) - {"__meta__"}
    assert cases == set(golden.CASES), (
        f"cases recorded but not in golden.CASES: {sorted(cases - set(golden.CASES))}; "
        f"in golden.CASES but not recorded: {sorted(set(golden.CASES) - cases)}")
    for name in golden.CASES:
        assert set(recording[name]) == set(golden.BACKENDS), name


def _check(recording, name: str, backend: str) -> None:
    _skip_unless_available(backend)
    expected = recording[name][backend]
    got = golden.run_case(name, backend)
    problems = golden.compare(expected, got)
    if problems:
        pytest.fail(f"case {name!r}, backend {backend!r}: {len(problems)} tensor(s) differ from the "
                    f"recording ({RECORDING}):\n  "
                    + "\n  ".join(f"{name}/{backend}/{p}" for p in problems), pytrace=False)


@pytest.mark.parametrize("name,backend", PARAMS)
def test_same_numbers(recording, name, backend):
    _check(recording, name, backend)


def test_same_numbers_two_threads(recording, one_thread):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("fewer than 2 cores")
    torch.set_num_threads(2)
    _check(recording, "lamb_large", "cpp")  # a 33001-element tensor: cpp forks its OpenMP region
