"""Golden ("same numbers") recording of FusedLAMB / FusedLARS: params and optimizer state after a
100-step run of every option set, on every backend that runs on a CPU-only machine (eager, cpp,
triton under Triton's interpreter).

Why: the layer between ``FusedLAMB.step()`` and the kernels is being rewritten. The rewrite must
give bit-identical params and optimizer state to the code before it; tests/test_golden.py reruns
every case below with the current code and compares it, bit for bit, with
tests/data/golden_131ab63.pt.

First recorded at commit 990dfdf ("functional: __all__ wrapped"), torch
2.13.0+cpu, triton 3.7.1, 2 intra-op threads, with a checkout of that commit whose extension was
built in place (BASE: a directory outside the clone; the clone's .venv)::

    git worktree add --detach BASE 990dfdf
    (cd BASE && FUSEDOPT_BUILD_CUDA=0 ../CLONE/.venv/bin/python setup.py build_ext --inplace)
    PYTHONPATH=BASE .venv/bin/python tests/golden.py \\
        --record tests/data/golden_990dfdf.pt --expect-source BASE

(``--expect-source`` refuses to record unless ``fusedopt.__file__`` lies under that directory;
the venv has the clone installed in editable mode, PYTHONPATH comes first.) The recording's
``"__meta__"`` entry keeps the commit, fusedopt's path, versions and date it was made with.

Commit 89780ab changed the eager backend's numbers on purpose (every product rounded before its
sum, correctly rounded square roots: docs/math.md); its eager entries were recorded the same way
at 89780ab (``--backends eager,cpp``), and golden_89780ab.pt is golden_990dfdf.pt
(in git history) with those eager entries: the cpp recording at 89780ab equals 990dfdf's in
every case, and 89780ab changed no Triton code (``"__meta__"["note"]`` says so).

Commit 131ab63 made the CPU float64 square roots correctly rounded (``lowp.sqrt_rn``: torch's is
MKL VML's, one ulp off for about 1% of inputs, by a path that depends on the CPU); it changed the
two float64 cases that clip (the clip norm's root) and nothing else. golden_131ab63.pt was
recorded at 131ab63 as above (every case and backend, ``--expect-source`` the clone itself), and
``--compare tests/data/golden_89780ab.pt`` (git history) against it differs in ``lamb_float64``
and ``lars_float64`` only; with MKL_CBWR=AVX2 (another VML path) the float64 cases give the same
tensors as without.

Determinism, checked when it was recorded: ``--check-determinism --backends eager,cpp`` (every
case with ``torch.set_num_threads(1)`` and again with 2 threads, compared bit for bit) found no
difference, and a second ``--record`` in another process with ``OMP_NUM_THREADS=1`` gave the same
tensors on all three backends (``--compare A.pt B.pt``); at 89780ab the eager entries again
showed no difference between 1 and 2 threads.

Once recorded, the cases must not change (a change needs a new recording under a new name): the
names, seeds (derived from the case name), shapes and options below are what the recording holds.

The script uses only public API that exists at 990dfdf (``fusedopt.FusedLAMB``, ``FusedLARS``,
``param_groups``, ``available_backends``) and torch, so it can run against that commit and against
any later one.

Format of the recording (``torch.load(path, weights_only=True)``): ``{case name: {backend:
{tensor name: value}}}`` plus ``"__meta__"`` (a dict of strings). Tensor names are ``param<i>``
(params in param-group order), ``state<i>.<key>`` (``opt.state_dict()["state"]``), ``skipped_steps``
and, for a tensor lr, ``group<g>.lr``. A value is the CPU tensor, except for tensors of more than
``DIGEST_NUMEL`` elements (the multi-chunk cases), stored as ``{"sha256", "shape", "dtype",
"head", "sum"}`` (digest of the raw bytes, first elements, float64 sum) to keep the file small;
the tensors of one case and backend are views of one flat tensor per dtype (one storage each).
"""
import os

if __name__ == "__main__":
    # Triton can only run CPU tensors through its interpreter, chosen when triton is first
    # imported. Under pytest, tests/conftest.py sets it (on machines without CUDA) instead.
    os.environ["TRITON_INTERPRET"] = "1"

import argparse
import datetime
import hashlib
import math
import subprocess
import sys
import zlib

import torch

import fusedopt

STEPS = 100
BACKENDS = ("eager", "cpp", "triton")
# Tensors with more elements are stored as a digest (see the module docstring).
DIGEST_NUMEL = 4096

LAMB_SHAPES = ((7, 5), (13,), (3, 4, 2))
LARS_SHAPES = LAMB_SHAPES
# 5000 elements: 3 chunks of the Triton interpreter's tiles (2048 elements), one of cpp.
# 33001 elements: 2 chunks of cpp's kChunk (32768), and a bucket big enough for cpp to fork
# its OpenMP region (with more than one thread).
LARGE_SHAPES = ((5000,), (33001,), (7, 5), (13,))
# 2500 elements: 2 chunks of the Triton interpreter's tiles, cheaper under the interpreter.
MIX_SHAPES = ((2500,), (7, 5), (13,), (3, 4, 2))


def _case(kind, *, lr=None, shapes=None, dtype=torch.float32, model=False, lr_kind="float",
          grad_scale=1.0, nonfinite=None, zero_weight=None, zero_grad=None, **opts):
    """One case. ``opts``: optimizer keyword arguments; ``model``: params of a tiny
    Sequential(Linear, LayerNorm, Linear) split by ``fusedopt.param_groups`` (biases and norm
    weights without decay and adaptation); ``lr_kind``: "float", "tensor" (a 0-dim float32
    tensor), "schedule" (a float set every step by LambdaLR) or "tensor_schedule" (a tensor lr that
    LambdaLR fills in place); ``grad_scale`` multiplies every gradient; ``nonfinite``:
    (step, value) put into one gradient element at that step; ``zero_weight`` / ``zero_grad``:
    index of a param that starts at 0 / whose gradient is always 0."""
    if lr is None:
        lr = 1e-2 if kind == "lamb" else 0.5
    if shapes is None:
        shapes = LAMB_SHAPES if kind == "lamb" else LARS_SHAPES
    return dict(kind=kind, lr=lr, shapes=tuple(shapes), dtype=dtype, model=model, lr_kind=lr_kind,
                grad_scale=grad_scale, nonfinite=nonfinite, zero_weight=zero_weight,
                zero_grad=zero_grad, opts=opts)


INF = float("inf")

CASES = {
    # ------------------------------------------------------------------ LAMB
    "lamb_default": _case("lamb"),
    "lamb_no_bias_correction": _case("lamb", bias_correction=False),
    "lamb_no_grad_averaging": _case("lamb", grad_averaging=False),
    "lamb_decoupled": _case("lamb", decoupled_weight_decay=True, weight_decay=0.1),
    "lamb_bounds": _case("lamb", trust_ratio_bounds=(0.5, 2.0)),
    "lamb_bounds_open": _case("lamb", trust_ratio_bounds=(0.0, INF)),
    "lamb_no_adapt": _case("lamb", adapt=False),
    "lamb_wd0": _case("lamb", weight_decay=0.0),
    "lamb_wd01": _case("lamb", weight_decay=0.1),
    # max_grad_norm=1.0 here only: dividing by 1.0 is exact, so a rewrite that drops the division
    # (or inverts it differently) would give the same bits; the other clipping cases use other norms.
    "lamb_clip": _case("lamb", max_grad_norm=1.0, grad_scale=4.0),
    "lamb_eps": _case("lamb", eps=1e-3),
    "lamb_betas": _case("lamb", betas=(0.8, 0.95)),
    "lamb_tensor_lr": _case("lamb", lr_kind="tensor"),
    "lamb_lr_schedule": _case("lamb", lr_kind="schedule"),
    "lamb_tensor_lr_schedule": _case("lamb", lr_kind="tensor_schedule"),
    "lamb_zero_norms": _case("lamb", zero_weight=0, zero_grad=2),
    "lamb_groups": _case("lamb", model=True, weight_decay=0.1),
    "lamb_groups_decoupled_clip_schedule": _case(
        "lamb", model=True, weight_decay=0.1, decoupled_weight_decay=True, max_grad_norm=0.8,
        grad_scale=4.0, lr_kind="schedule", trust_ratio_bounds=(0.5, 2.0)),
    "lamb_bf16": _case("lamb", dtype=torch.bfloat16),
    "lamb_bf16_groups_clip": _case("lamb", dtype=torch.bfloat16, model=True, weight_decay=0.1,
                                   max_grad_norm=0.9, grad_scale=4.0),
    "lamb_bf16_no_master": _case("lamb", dtype=torch.bfloat16, master_weights=False),
    "lamb_float64": _case("lamb", dtype=torch.float64, max_grad_norm=2.5, grad_scale=4.0),
    "lamb_skip_nonfinite": _case("lamb", skip_nonfinite=True, nonfinite=(37, INF)),
    "lamb_skip_nonfinite_clip": _case("lamb", skip_nonfinite=True, nonfinite=(37, float("nan")),
                                      max_grad_norm=1.3, grad_scale=4.0),
    "lamb_large": _case("lamb", shapes=LARGE_SHAPES, max_grad_norm=1.5, grad_scale=4.0),
    # several options at once (the Triton subset of tests/test_golden.py runs these)
    "lamb_mix": _case("lamb", shapes=MIX_SHAPES, bias_correction=False, grad_averaging=False,
                      eps=1e-3, betas=(0.8, 0.95), trust_ratio_bounds=(0.0, INF), lr_kind="tensor",
                      max_grad_norm=0.7, grad_scale=4.0, skip_nonfinite=True,
                      nonfinite=(37, float("nan")), weight_decay=0.1),
    "lamb_bf16_groups_mix": _case("lamb", dtype=torch.bfloat16, model=True, weight_decay=0.1,
                                  decoupled_weight_decay=True, trust_ratio_bounds=(0.5, 2.0),
                                  lr_kind="schedule", skip_nonfinite=True, nonfinite=(37, INF)),
    # ------------------------------------------------------------------ LARS
    "lars_default": _case("lars"),  # weight_decay=0, the default
    "lars_sum": _case("lars", denominator="sum", weight_decay=1e-2),
    "lars_combined": _case("lars", denominator="combined", weight_decay=1e-2),
    "lars_trust_clip": _case("lars", trust_clip=True, trust_coefficient=1.0, weight_decay=1e-4),
    "lars_nesterov": _case("lars", nesterov=True, weight_decay=1e-4),
    "lars_sgd_dampening": _case("lars", lr_in_momentum=False, dampening=0.1, weight_decay=1e-4),
    "lars_sgd_nesterov": _case("lars", lr_in_momentum=False, nesterov=True, weight_decay=1e-4),
    "lars_no_momentum": _case("lars", momentum=0.0, weight_decay=1e-4),
    "lars_wd1e-4": _case("lars", weight_decay=1e-4),
    "lars_trust_coefficient": _case("lars", trust_coefficient=0.02, weight_decay=1e-4),
    "lars_eps": _case("lars", eps=1e-1, weight_decay=1e-4),
    "lars_clip": _case("lars", max_grad_norm=0.7, grad_scale=4.0, weight_decay=1e-4),
    "lars_no_adapt": _case("lars", adapt=False, lr=0.05, weight_decay=1e-4),
    "lars_tensor_lr": _case("lars", lr_kind="tensor", weight_decay=1e-4),
    "lars_lr_schedule": _case("lars", lr_kind="schedule", weight_decay=1e-4),
    "lars_zero_norms": _case("lars", zero_weight=0, zero_grad=2, weight_decay=1e-4),
    "lars_groups": _case("lars", model=True, weight_decay=1e-4),
    "lars_groups_combined_clip_schedule": _case(
        "lars", model=True, weight_decay=1e-2, denominator="combined", trust_clip=True,
        max_grad_norm=0.8, grad_scale=4.0, lr_kind="tensor_schedule"),
    "lars_bf16": _case("lars", dtype=torch.bfloat16, weight_decay=1e-4),
    "lars_bf16_groups_nesterov": _case("lars", dtype=torch.bfloat16, model=True, weight_decay=1e-4,
                                       nesterov=True),
    "lars_float64": _case("lars", dtype=torch.float64, weight_decay=1e-4, lr_in_momentum=False,
                          max_grad_norm=2.5, grad_scale=4.0),
    "lars_skip_nonfinite": _case("lars", skip_nonfinite=True, nonfinite=(37, INF),
                                 weight_decay=1e-4),
    "lars_skip_nonfinite_clip": _case("lars", skip_nonfinite=True, nonfinite=(37, -INF),
                                      max_grad_norm=1.3, grad_scale=4.0, weight_decay=1e-4),
    "lars_large": _case("lars", shapes=LARGE_SHAPES, weight_decay=1e-4, max_grad_norm=1.5,
                        grad_scale=4.0),
    "lars_mix": _case("lars", shapes=MIX_SHAPES, lr_in_momentum=False, dampening=0.1,
                      momentum=0.8, trust_coefficient=0.02, eps=1e-1, lr_kind="tensor",
                      weight_decay=1e-4, skip_nonfinite=True, nonfinite=(37, INF)),
    "lars_bf16_no_master_nesterov": _case("lars", dtype=torch.bfloat16, master_weights=False,
                                          nesterov=True, weight_decay=1e-4),
}


def _seed(name: str, step: int) -> int:
    """A seed of its own for the params (step -1) and for each step's gradients of a case."""
    return zlib.crc32(name.encode()) * 1009 + step + 1


def _randn(shape, gen) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32)


def _build(name: str, case: dict):
    """The case's params (leaves, in a fixed order) and the param groups to give the optimizer."""
    gen = torch.Generator().manual_seed(_seed(name, -1))
    if case["model"]:
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7),
                                    torch.nn.Linear(7, 3))
        with torch.no_grad():  # the initial values from our generator, not torch's global RNG
            for p in model.parameters():
                p.copy_(_randn(p.shape, gen))
        model.to(case["dtype"])
        params = list(model.parameters())
        groups = fusedopt.param_groups(model, weight_decay=case["opts"].get("weight_decay", 0.0))
        return params, groups
    params = []
    for i, shape in enumerate(case["shapes"]):
        t = _randn(shape, gen)
        if i == case["zero_weight"]:
            t.zero_()
        params.append(torch.nn.Parameter(t.to(case["dtype"])))
    return params, params


def _lr(case: dict):
    if case["lr_kind"] in ("tensor", "tensor_schedule"):
        return torch.tensor(case["lr"], dtype=torch.float32)
    return case["lr"]


def _lr_factor(step: int) -> float:
    """The schedule: a short warmup, then a cosine decay."""
    if step < 10:
        return (step + 1) / 10
    return 0.5 * (1.0 + math.cos(math.pi * (step - 10) / (STEPS - 10)))


def _grads(name: str, case: dict, params, step: int):
    """The gradients of ``step``: float32 normal numbers from a generator of their own, times
    ``grad_scale``, cast to each param's dtype (identical for every backend)."""
    gen = torch.Generator().manual_seed(_seed(name, step))
    out = []
    for i, p in enumerate(params):
        g = _randn(p.shape, gen) * case["grad_scale"]
        if i == case["zero_grad"]:
            g.zero_()
        out.append(g)
    if case["nonfinite"] is not None and step == case["nonfinite"][0]:
        out[0].view(-1)[3] = case["nonfinite"][1]
    max_norm = case["opts"].get("max_grad_norm")
    if max_norm is not None and case["nonfinite"] is None:
        total = math.sqrt(sum(float(g.double().square().sum()) for g in out))
        assert total > 2 * max_norm, f"{name}: step {step} would not clip ({total})"
    return [g.to(p.dtype) for g, p in zip(out, params)]


def _store(t: torch.Tensor):
    t = t.detach().to("cpu").clone()
    if t.numel() <= DIGEST_NUMEL:
        return t
    return _digest(t)


def _digest(t: torch.Tensor) -> dict:
    flat = t.contiguous().view(-1)
    raw = flat.view(_INT[t.dtype]).numpy().tobytes()
    return {"sha256": hashlib.sha256(raw).hexdigest(), "shape": tuple(t.shape),
            "dtype": str(t.dtype), "head": flat[:32].clone(), "sum": float(flat.double().sum())}


_INT = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
        torch.float16: torch.int16, torch.int64: torch.int64, torch.int32: torch.int32}


def run_case(name: str, backend: str, steps: int = STEPS) -> dict:
    """Run case ``name`` for ``steps`` steps on ``backend``; the recorded tensors (see the module
    docstring)."""
    case = CASES[name]
    params, groups = _build(name, case)
    cls = fusedopt.FusedLAMB if case["kind"] == "lamb" else fusedopt.FusedLARS
    opt = cls(groups, lr=_lr(case), backend=backend, **case["opts"])
    sched = None
    if case["lr_kind"] in ("schedule", "tensor_schedule"):
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_factor)
    for step in range(steps):
        for p, g in zip(params, _grads(name, case, params, step)):
            p.grad = g
        opt.step()
        if sched is not None:
            sched.step()
    for p in params:
        p.grad = None
    skipped = int(opt.skipped_steps)
    expected_skips = 1 if case["nonfinite"] is not None and case["nonfinite"][0] < steps else 0
    assert skipped == expected_skips, f"{name}/{backend}: {skipped} skipped steps"
    out = {f"param{i}": _store(p) for i, p in enumerate(params)}
    sd = opt.state_dict()
    for idx, st in sd["state"].items():
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                out[f"state{idx}.{key}"] = _store(value)
    out["skipped_steps"] = _store(opt.skipped_steps)
    for gi, g in enumerate(sd["param_groups"]):
        if isinstance(g["lr"], torch.Tensor):
            out[f"group{gi}.lr"] = _store(g["lr"])
    return out


def backend_unavailable(backend: str) -> str | None:
    """None if ``backend`` runs CPU tensors in this process, else why not."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        return ("Triton runs CPU tensors only under its interpreter (TRITON_INTERPRET=1 before "
                "triton is first imported; tests/conftest.py sets it on machines without CUDA)")
    if backend in fusedopt.available_backends():
        return None
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    try:
        fusedopt.FusedLAMB([p], backend=backend).step()
    except Exception as e:  # noqa: BLE001 - the reason is what we want
        return f"{type(e).__name__}: {e}"
    return "not in fusedopt.available_backends()"


# ---------------------------------------------------------------------------------- comparing

def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT[t.dtype]) if t.dtype in _INT else t


def _describe(exp: torch.Tensor, got: torch.Tensor) -> str:
    if exp.shape != got.shape or exp.dtype != got.dtype:
        return f"expected {exp.dtype}{tuple(exp.shape)}, got {got.dtype}{tuple(got.shape)}"
    bad = (_bits(exp) != _bits(got))
    n = int(bad.sum())
    first = int(bad.view(-1).nonzero()[0]) if n else -1
    diff = (exp.double() - got.double()).abs()
    diff = diff[torch.isfinite(diff)]
    worst = float(diff.max()) if diff.numel() else float("nan")
    return (f"{n} of {exp.numel()} elements differ (first at flat index {first}: expected "
            f"{exp.reshape(-1)[first].item()!r}, got {got.reshape(-1)[first].item()!r}; "
            f"max abs diff {worst:.3g})")


def compare(expected: dict, got: dict) -> list[str]:
    """Differences between two results of one case and backend (empty: bit-identical). NaNs
    compare equal to the same NaN; -0.0 and 0.0 differ."""
    problems = []
    for key in sorted(set(expected) | set(got)):
        if key not in got:
            problems.append(f"{key}: recorded but not produced")
            continue
        if key not in expected:
            problems.append(f"{key}: produced but not recorded")
            continue
        exp, val = expected[key], got[key]
        if isinstance(exp, dict) and not isinstance(val, dict):
            val = _digest(val)
        elif isinstance(val, dict) and not isinstance(exp, dict):
            exp = _digest(exp)
        if isinstance(exp, dict):
            if (exp["sha256"], tuple(exp["shape"]), exp["dtype"]) != (
                    val["sha256"], tuple(val["shape"]), val["dtype"]):
                head = _describe(exp["head"], val["head"]) if exp["head"].shape == val[
                    "head"].shape else "shapes differ"
                problems.append(f"{key}: digest differs ({exp['dtype']}{tuple(exp['shape'])} vs "
                                f"{val['dtype']}{tuple(val['shape'])}; sum {exp['sum']!r} vs "
                                f"{val['sum']!r}; first 32 elements: {head})")
        elif not (exp.shape == val.shape and exp.dtype == val.dtype
                  and torch.equal(_bits(exp), _bits(val))):
            problems.append(f"{key}: {_describe(exp, val)}")
    return problems


# ---------------------------------------------------------------------------------- command line

def _meta(expect_source: str | None) -> dict:
    src = os.path.dirname(os.path.dirname(os.path.abspath(fusedopt.__file__)))
    if expect_source is not None:
        want = os.path.realpath(expect_source)
        if not os.path.realpath(fusedopt.__file__).startswith(want + os.sep):
            sys.exit(f"fusedopt is imported from {fusedopt.__file__}, not from {want}")
    try:
        commit = subprocess.run(["git", "-C", src, "rev-parse", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", src, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = "unknown", ""
    try:
        import triton
        triton_version = str(triton.__version__)
    except ImportError:
        triton_version = "none"
    return {"commit": commit + (" (modified)" if dirty else ""),
            "fusedopt_file": fusedopt.__file__, "torch": str(torch.__version__),
            "triton": triton_version,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "threads": str(torch.get_num_threads()), "steps": str(STEPS)}


def _pack(result: dict) -> dict:
    """The same tensors as views of one flat tensor per dtype (torch.save writes a storage once:
    a few hundred bytes per tensor saved)."""
    by_dtype: dict = {}
    for key, t in result.items():
        if isinstance(t, torch.Tensor):
            by_dtype.setdefault(t.dtype, []).append(key)
    out = dict(result)
    for keys in by_dtype.values():
        flat = torch.cat([result[k].reshape(-1) for k in keys])
        offset = 0
        for k in keys:
            t = result[k]
            out[k] = flat[offset:offset + t.numel()].view(t.shape)
            offset += t.numel()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--record", metavar="PATH", help="run every case and backend, save to PATH")
    ap.add_argument("--expect-source", metavar="DIR",
                    help="refuse to run unless fusedopt is imported from under DIR")
    ap.add_argument("--check-determinism", action="store_true",
                    help="run every case and backend with 1 and with 2 threads and compare")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two recordings")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    args = ap.parse_args(argv)
    backends = tuple(args.backends.split(","))
    names = args.cases.split(",") if args.cases else list(CASES)
    meta = _meta(args.expect_source)
    print(f"fusedopt from {meta['fusedopt_file']} at {meta['commit']}; torch {meta['torch']}, "
          f"{meta['threads']} threads", flush=True)
    for backend in backends:
        reason = backend_unavailable(backend)
        if reason is not None:
            sys.exit(f"backend {backend!r} is not available: {reason}")
    status = 0
    if args.compare:
        a, b = (torch.load(p, weights_only=True) for p in args.compare)
        keys = sorted((set(a) | set(b)) - {"__meta__"})
        for name in keys:
            for backend in sorted(set(a.get(name, {})) | set(b.get(name, {}))):
                problems = compare(a.get(name, {}).get(backend, {}), b.get(name, {}).get(backend, {}))
                for p in problems:
                    print(f"DIFF {name}/{backend}: {p}")
                    status = 1
        print("identical" if not status else "recordings differ")
    if args.check_determinism:
        saved = torch.get_num_threads()
        for name in names:
            for backend in backends:
                torch.set_num_threads(1)
                one = run_case(name, backend)
                torch.set_num_threads(2)
                two = run_case(name, backend)
                for p in compare(one, two):
                    print(f"THREADS {name}/{backend}: {p}")
                    status = 1
        torch.set_num_threads(saved)
        print("1 and 2 threads: " + ("identical" if not status else "DIFFER"))
    if args.record:
        import time
        rec = {}
        for name in names:
            rec[name] = {}
            t0 = time.perf_counter()
            for backend in backends:
                t1 = time.perf_counter()
                rec[name][backend] = _pack(run_case(name, backend))
                rec[name][f"_time_{backend}"] = time.perf_counter() - t1
            times = " ".join(f"{b}={rec[name].pop(f'_time_{b}'):.2f}s" for b in backends)
            same = [b for b in backends[1:] if not compare(rec[name][backends[0]], rec[name][b])]
            print(f"{name:40s} {len(rec[name][backends[0]]):3d} tensors  {times}"
                  f"  same as {backends[0]}: {','.join(same) or '-'}", flush=True)
        rec["__meta__"] = meta
        os.makedirs(os.path.dirname(os.path.abspath(args.record)), exist_ok=True)
        torch.save(rec, args.record)
        print(f"wrote {args.record}: {len(names)} cases x {len(backends)} backends, "
              f"{os.path.getsize(args.record)} bytes")
    return status


if __name__ == "__main__":
    sys.exit(main())
