"""The mutation check of the emulated CUDA tests (docs/cuda_emulation.md, "The mutation check").

Each mutation plants one known bug in the CUDA sources by an exact text substitution: a barrier
removed from the block reduction, from the broadcast or from the reduction over an 8-bit block,
one pointer removed from an alignment test (also in the low-precision passes), a slip in the
8-bit maps or the random bits, LARS stepping by its rounded buffer. The LAMB/LARS step tests of
tests/test_cuda_emulated.py and tests/test_cuda_lowp.py must catch each of them by themselves:
the sums-of-squares tests and the tests that only compare scheduling orders are not run here.

For every mutation, csrc/ is copied to a temporary directory and the substitution applied to the
copy (the original text must occur exactly once, or the script stops: a mutation that changes
nothing cannot pass for caught). A pytest subprocess then builds the emulation from the copy
(FUSEDOPT_CSRC_DIR, never cached) and runs the step tests, without pytest's cache provider, so
that the checkout's .pytest_cache is left as it was. An unmodified copy runs first, as the
control: every step test must pass on it, so that a failure under a mutation is the mutation's.

    python tests/simt_mutations.py                        # the control and every mutation
    python tests/simt_mutations.py -m broadcast_barrier   # one (repeatable), with the control
    python tests/simt_mutations.py --no-control -x        # no control; stop at a first failure

The exit status is 0 when the control passes and every mutation is caught, 1 otherwise.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from build_cache import run

ROOT = Path(__file__).resolve().parents[1]
TEST_FILE = "tests/test_cuda_emulated.py"
TIMEOUT_S = 1800


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # relative to csrc/
    old: str   # must occur exactly once in the file
    new: str
    what: str


MUTATIONS = [
    Mutation(
        "block_sum_barrier", "cuda/multi_tensor_apply.cuh",
        "    if (lane == 0) warp_sums[k][warp] = v[k];\n"
        "  }\n"
        "  __syncthreads();\n"
        "  if (warp == 0) {\n",
        "    if (lane == 0) warp_sums[k][warp] = v[k];\n"
        "  }\n"
        "  if (warp == 0) {\n",
        "block_sum without the __syncthreads between the warps' writes of their sums and warp "
        "0's reads"),
    Mutation(
        "broadcast_barrier", "cuda/multi_tensor_apply.cuh",
        "  if (threadIdx.x == 0) value = f();\n  __syncthreads();\n  return value;\n",
        "  if (threadIdx.x == 0) value = f();\n  return value;\n",
        "block_broadcast without the __syncthreads between thread 0's write and the block's "
        "reads"),
    Mutation(
        "alignment_check", "cuda/lamb.cu",
        "for_each_group<N>(count, all_aligned(w, g, m, v), [&](int off, int n, bool vec) {",
        "for_each_group<N>(count, all_aligned(w, g, m), [&](int off, int n, bool vec) {",
        "LAMB pass 1 (full state) decides on vector accesses without testing v's alignment"),
    # the alignment checks of the low-precision passes (csrc/cuda/lowp.cuh formats), one list each
    Mutation(
        "lowp_lamb1_w", "cuda/lamb.cu",
        "const bool vec = all_aligned(w, g);\n    const bool vec8 = all_aligned8(m.codes, v.codes);",
        "const bool vec = all_aligned(g);\n    const bool vec8 = all_aligned8(m.codes, v.codes);",
        "low-precision LAMB pass 1 without testing the weights' alignment"),
    Mutation(
        "lowp_lamb1_v", "cuda/lamb.cu",
        "const bool vec = all_aligned(w, g);\n    const bool vec8 = all_aligned8(m.codes, v.codes);",
        "const bool vec = all_aligned(w, g);\n    const bool vec8 = all_aligned8(m.codes);",
        "low-precision LAMB pass 1 without testing the 8-bit v codes' alignment"),
    Mutation(
        "lowp_lamb2_p", "cuda/lamb.cu",
        "kHasParam ? all_aligned(w, p) : all_aligned(w);",
        "kHasParam ? all_aligned(w) : all_aligned(w);",
        "low-precision LAMB pass 2 without testing the low-precision params' alignment"),
    Mutation(
        "lowp_lamb2_m", "cuda/lamb.cu",
        "const bool vec8 = all_aligned8(m.codes);",
        "const bool vec8 = true;",
        "8-bit LAMB pass 2 without testing the direction codes' alignment"),
    Mutation(
        "lowp_lars_g", "cuda/lars.cu",
        "kHasParam ? all_aligned(w, g, p) : all_aligned(w, g);",
        "kHasParam ? all_aligned(w, p) : all_aligned(w);",
        "low-precision LARS without testing the grads' alignment"),
    Mutation(
        "lowp_lars_codes", "cuda/lars.cu",
        "const bool vec8 = all_aligned8(buf.codes);",
        "const bool vec8 = true;",
        "8-bit LARS without testing the buffer codes' alignment"),
    # the 8-bit blocks' reduction and the maps (Note [8-bit maps] in csrc/fusedopt/math.h)
    Mutation(
        "q8_block_barrier", "cuda/lowp.cuh",
        "    if (lane == 0) tops[buf][k][warp] = t;\n  }\n  __syncthreads();\n",
        "    if (lane == 0) tops[buf][k][warp] = t;\n  }\n",
        "block_max without the __syncthreads between lane 0's write of its warp's maximum and "
        "the other lanes' reads"),
    Mutation(
        "q8_root_low", "cuda/lowp.cuh",
        "x[1] = max_u32(x[1], b == 0u ? 0u : ~b);",
        "x[1] = max_u32(x[1], ~b);",
        "the root map's shift from the smallest root counting the roots 0"),
    Mutation(
        "q8_random_bits", "cuda/lamb.cu",
        "const unsigned int bits = sr_bits(sc.base, sc.first + begin + off + k);",
        "const unsigned int bits = sr_bits(sc.base, begin + off + k);",
        "the root codes' random bits counted from the run's first element instead of the whole "
        "tensor's (docs/math.md, \"Random bits\")"),
    Mutation(
        "q8_dynamic_units", "cuda/lowp.cuh",
        "if (i < 128) t.unit[i] = q8_dynamic_unit(i);",
        "if (i < 64) t.unit[i] = q8_dynamic_unit(i);",
        "the dynamic map's table of values without its upper half (the values of the top "
        "decade)"),
    Mutation(
        "q8_dynamic_mids", "cuda/lowp.cuh",
        "else if (i < kDynamicValues) t.thr[i - 128] = q8_dynamic_threshold(i - 128);",
        "else if (i < kDynamicValues - 2) t.thr[i - 128] = q8_dynamic_threshold(i - 128);",
        "the dynamic map's thresholds without the last two (the midpoint between the two "
        "largest magnitudes, and the end)"),
    Mutation(
        "lars_rounded_step", "cuda/lars.cu",
        "wr[k] = lars_step<float>(wr[k], d, vk, sc.c);",
        "wr[k] = lars_step<float>(wr[k], d, bf16_value(vr[k]), sc.c);",
        "LARS with a bf16 buffer stepping by the rounded buffer instead of the float32 one"),
]

# The LAMB/LARS step tests: each runs the passes of the optimizer and checks its results (against
# the float64 reference, bit for bit across layouts, or both). Left out: the emulator's own tests,
# the sums-of-squares tests and test_scheduling_order_does_not_change_a_bit. They run in this
# order, the layouts first: with --first-failure every mutation above stops at its first test.
STEP_TESTS = {
    TEST_FILE: [
        "test_alignment_does_not_change_a_bit", "test_lamb_flags", "test_lars_flags", "test_dtypes",
        "test_grad_mult", "test_found_inf", "test_lr_tensor", "test_more_tensors_than_a_table_holds",
        "test_chunk_boundaries", "test_a_tensor_of_more_chunks_than_a_warp_has_lanes",
        "test_a_bucket_of_empty_tensors",
        "test_empty_tensors_first_and_last", "test_nan_norms_give_nan_trust_ratios",
    ],
    # the low-precision passes, each step compared bit for bit with the cpp backend (left out:
    # test_schedules_and_alignment_do_not_change_a_bit, a scheduling test)
    "tests/test_cuda_lowp.py": [
        "test_one_list_misaligned", "test_lamb_equals_cpp_bit_for_bit",
        "test_lars_equals_cpp_bit_for_bit", "test_lamb_options", "test_lars_options",
        "test_global_clipping_and_a_tensor_lr", "test_found_inf_changes_nothing", "test_bf16_params",
        "test_fp16_masters", "test_a_block_that_is_not_finite", "test_special_gradients",
        "test_many_tensors_split_the_launches",
    ],
}


@dataclass
class Outcome:
    passed: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (test, first line of why)
    errors: list[tuple[str, str]] = field(default_factory=list)  # setup errors (the build)
    seconds: float = 0.0
    output: str = ""

    @property
    def ran(self) -> int:
        return len(self.passed) + len(self.failed) + len(self.errors)


def _step_test_ids() -> list[str]:
    ids = []
    for file, names in STEP_TESTS.items():
        text = (ROOT / file).read_text()
        missing = [name for name in names if f"\ndef {name}(" not in text]
        if missing:
            raise SystemExit(f"simt_mutations: no test {missing} in {file}: update STEP_TESTS")
        ids += [f"{file}::{name}" for name in names]
    return ids


def mutate(csrc: Path, m: Mutation) -> None:
    """Applies ``m`` to the copy ``csrc``; stops unless its text occurs exactly once."""
    path = csrc / m.file
    text = path.read_text()
    count = text.count(m.old)
    if count != 1:
        raise SystemExit(f"simt_mutations: the text of mutation {m.name} occurs {count} times in "
                         f"csrc/{m.file} (must be once): update MUTATIONS")
    path.write_text(text.replace(m.old, m.new))


def run_step_tests(csrc: Path, work: Path, first_failure: bool = False) -> Outcome:
    """The step tests, in a pytest subprocess, against the emulation built from ``csrc``."""
    report = work / "report.xml"
    # -n 1: the tests run in an xdist worker, so that a mutant that crashes the process (a wild
    # write of the emulated kernel) fails the test that crashed and the others still run
    cmd = [sys.executable, "-m", "pytest", *_step_test_ids(), "-q", "-n", "1", "-p", "no:cacheprovider",
           f"--basetemp={work / 'pytest'}", f"--junitxml={report}", "-o", "junit_family=xunit1"]
    if first_failure:
        cmd.append("-x")
    env = {**os.environ, "FUSEDOPT_CSRC_DIR": str(csrc)}
    start = time.perf_counter()
    p = run(cmd, TIMEOUT_S, cwd=ROOT, env=env)
    out = Outcome(seconds=time.perf_counter() - start, output=p.stdout + p.stderr)
    if not report.is_file():
        out.errors.append(("pytest", f"exit status {p.returncode}, no report"))
        return out
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("name", "?")
        failure, error = case.find("failure"), case.find("error")
        if failure is not None:
            out.failed.append((name, (failure.get("message") or "").splitlines()[0][:320]))
        elif error is not None:
            why = (error.get("message") or "").splitlines()[0][:320]
            # a test that crashed its worker failed (the build's errors are the setup errors)
            (out.failed if "crashed while running" in why else out.errors).append((name, why))
        elif case.find("skipped") is None:
            out.passed.append(name)
    return out


def check(names: list[str] | None = None, *, control: bool = True, first_failure: bool = False,
          log=print) -> dict[str, Outcome]:
    """Runs the control (unless ``control`` is false) and the mutations ``names`` (default: all);
    returns their outcomes by name ("control" for the control)."""
    chosen = [m for m in MUTATIONS if names is None or m.name in names]
    unknown = set(names or ()) - {m.name for m in MUTATIONS}
    if unknown:
        raise SystemExit(f"simt_mutations: no mutation {sorted(unknown)}; "
                         f"there are {[m.name for m in MUTATIONS]}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="simt-mutations-") as tmp:
        for m in ([None] if control else []) + chosen:
            name = "control" if m is None else m.name
            work = Path(tmp) / name
            csrc = work / "csrc"
            shutil.copytree(ROOT / "csrc", csrc)
            if m is not None:
                mutate(csrc, m)
            log(f"{name}: " + ("csrc/ unmodified" if m is None else f"csrc/{m.file}: {m.what}"))
            results[name] = outcome = run_step_tests(csrc, work, first_failure)
            log("  " + summary(name, outcome))
    return results


def caught(outcome: Outcome) -> bool:
    """Some step test failed, and every test ran (none stopped at its setup, i.e. the build)."""
    return bool(outcome.failed) and not outcome.errors


def passed(outcome: Outcome) -> bool:
    """Step tests ran, and every one passed."""
    return bool(outcome.passed) and not outcome.failed and not outcome.errors


def summary(name: str, o: Outcome) -> str:
    if o.errors:
        head = f"ERROR: {len(o.errors)} tests did not run: {o.errors[0][0]}: {o.errors[0][1]}"
        return head + "\n" + o.output[-3000:]
    if name == "control":
        verdict = "passed" if passed(o) else "FAILED"
    else:
        verdict = "caught" if caught(o) else "MISSED"
    line = (f"{verdict}: {len(o.failed)} of {o.ran} step tests failed ({o.seconds:.0f} s, "
            "build included)")
    if o.failed:
        per_test: dict[str, int] = {}
        for test, _ in o.failed:
            per_test[test.split("[")[0]] = per_test.get(test.split("[")[0], 0) + 1
        line += "\n    " + ", ".join(f"{t} ({n})" for t, n in per_test.items())
        line += f"\n    first: {o.failed[0][0]}: {o.failed[0][1]}"
    return line


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--mutation", action="append", choices=[m.name for m in MUTATIONS],
                    help="run this mutation (repeatable; default: all)")
    ap.add_argument("--no-control", action="store_true",
                    help="skip the control run on unmodified sources")
    ap.add_argument("-x", "--first-failure", action="store_true",
                    help="stop each run at its first failing test (caught, without the full list)")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = ap.parse_args(argv)
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name}: csrc/{m.file}: {m.what}\n  - {m.old!r}\n  + {m.new!r}")
        return 0
    start = time.perf_counter()
    results = check(args.mutation, control=not args.no_control,
                    first_failure=args.first_failure)
    verdicts = {name: (passed(o) if name == "control" else caught(o))
                 for name, o in results.items()}
    ok = all(verdicts.values())
    print(f"{'OK' if ok else 'FAILED'}: " + ", ".join(
        f"{name} " + (("passed" if good else "FAILED") if name == "control"
                      else ("caught" if good else "MISSED"))
        for name, good in verdicts.items()) + f" ({time.perf_counter() - start:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
