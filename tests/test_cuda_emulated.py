"""The CUDA kernels of csrc/cuda, run on the CPU through the SIMT emulation of tests/simt.

The host C++ compiler builds the real ``csrc/cuda/{lamb,lars,norms}.cu`` (``-x c++``) against the
test-only CUDA headers of ``tests/simt/include`` (first on the include path, so the toolkit's
headers are never read) into a shared library with the C driver ``tests/simt/driver.cpp``, loaded
here with ctypes. Every thread of a block runs as a fiber, so ``__syncthreads`` and
``__shfl_down_sync`` keep their meaning; docs/cuda_emulation.md says what is emulated and what is
not (FMA contraction, memory ordering between blocks, independent thread scheduling, ...).

The launchers get raw pointers exactly as the torch binding (csrc/cuda/bindings.cpp) passes them;
pass 1's sums go straight to pass 2. Results are compared with the float64 reference
(fusedopt/reference.py) at the tolerances of the C++ CPU backend's tests (tests/test_cpp.py), and
with themselves, bit for bit, across memory alignments and scheduling orders. Every tensor lies
inside a larger buffer whose guard elements must come out untouched. The optimizer's kernels run
under the warp-skewed schedule (warp 0 alone up to each __syncthreads, lanes from the last), in
which a missing barrier changes results; a misaligned vector access is a launch failure.

FUSEDOPT_CSRC_DIR names another copy of csrc/ to build (tests/simt_mutations.py builds mutants of
the CUDA sources that way); such a build is never cached.
"""
from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import inspect
import json
import math
import os
import shlex
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from build_cache import Cache, Hasher, run
from fusedopt import _hyper
from fusedopt.reference import ReferenceLAMB, ReferenceLARS
from fusedopt.testing import (
    LR, REL_TOL, ROUNDING_ATOL, assert_within_rounding, make_tensors, option_cases, run_backend,
)
from helpers import NAN_RULE_CASES, assert_nan_rule, nan_rule_inputs

ROOT = Path(__file__).resolve().parents[1]
SIMT = ROOT / "tests" / "simt"
DEFAULT_CSRC = (ROOT / "csrc").resolve()
# the sources built: csrc/ or a copy of it (FUSEDOPT_CSRC_DIR: tests/simt_mutations.py)
CSRC = Path(os.environ.get("FUSEDOPT_CSRC_DIR") or DEFAULT_CSRC).resolve()
CUDA_SOURCES = [CSRC / "cuda" / f"{name}.cu" for name in ("lamb", "lars", "norms")]
SIMT_SOURCES = [SIMT / "runtime.cpp", SIMT / "driver.cpp", SIMT / "selftest.cpp"]
CXX = shutil.which("g++") or shutil.which("c++")
# -ffp-contract=off: no a*b+c is fused into an FMA, so every operation rounds as written (nvcc
# contracts by default: on a GPU the last bits may differ; docs/cuda_emulation.md).
# -fsanitize=alignment: every load and store checks that its address is aligned to its type; a
# failed check stops the thread and the launch fails with cudaErrorMisalignedAddress, as on the
# device (the handlers are tests/simt/runtime.cpp's: the sanitizer's runtime is not linked).
CXX_FLAGS = ["-std=c++20", "-O2", "-fPIC", "-ffp-contract=off", "-fno-fast-math", "-Wall",
             "-Wextra", "-Wno-unknown-pragmas",  # nvcc's #pragma unroll
             "-fsanitize=alignment", "-fno-sanitize-recover=alignment",
             "-I", str(SIMT / "include"),  # first: before any CUDA toolkit directory
             "-I", str(CSRC), "-I", str(CSRC / "cuda")]
# Extra flags for the emulation build, e.g. "-fsanitize=undefined -fno-sanitize-recover=all"
# (docs/cuda_emulation.md).
EXTRA_FLAGS = shlex.split(os.environ.get("FUSEDOPT_SIMT_CXXFLAGS", ""))
BUILD_TIMEOUT_S = 600

pytestmark = pytest.mark.skipif(
    CXX is None, reason="no host C++ compiler (g++ or c++ on PATH): the CUDA sources cannot be "
    "built for the SIMT emulation")

DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
MISALIGNED, LAUNCH_FAILURE, NOT_SUPPORTED = 716, 719, 801
# simt::Order: the round-robin orders (threads and blocks), and the warp-skewed ones (threads only)
FORWARD, REVERSE, RANDOM, WARP_SKEW, WARP_SKEW_RANDOM = 0, 1, 2, 3, 4
# tolerances of fusedopt.testing: max_rel_err against the float64 reference
TOL = REL_TOL
# sums of squares against the exact float64 sums (test_cpp.test_sq_norms)
SUM_RTOL = {torch.float32: 1e-5, torch.float64: 1e-12}
# the within-rounding rule of fusedopt.testing (and test_cpp.test_low_precision_within_rounding)
LOW_ATOL = ROUNDING_ATOL


# --------------------------------------------------------------------------------- build

def _name(path: Path) -> str:
    """A source's name in the build's logs and dependency lists: csrc/... for the sources built
    (wherever CSRC is), tests/simt/... for the emulation's."""
    path = Path(path)
    if path.is_relative_to(CSRC):
        return (Path("csrc") / path.relative_to(CSRC)).as_posix()
    return path.relative_to(ROOT).as_posix()


def _compile(src: Path, obj: Path) -> tuple[int, str]:
    lang = ["-x", "c++"] if src.suffix == ".cu" else []
    cmd = [CXX, *CXX_FLAGS, *EXTRA_FLAGS, "-MD", "-MF", str(obj.with_suffix(".d")), *lang,
           "-c", str(src), "-o", str(obj)]
    p = run(cmd, BUILD_TIMEOUT_S)
    return p.returncode, p.stdout + p.stderr


@dataclass
class Build:
    lib: Path
    seconds: float
    logs: dict[str, str]
    deps: dict[str, list[str]]


LIB = "libfusedopt_simt.so"


def _build_into(out: Path) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Compile and link the emulation library into ``out``, two compilers at a time; the compiler's
    output and the files read (from its dependency file), per source."""
    sources = CUDA_SOURCES + SIMT_SOURCES
    objs = [out / (s.stem + (".cu" if s.suffix == ".cu" else "") + ".o") for s in sources]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(_compile, sources, objs))
    logs = {_name(s): log for s, (_, log) in zip(sources, results)}
    for s, (rc, log) in zip(sources, results):
        assert rc == 0, f"{CXX} failed on {s}:\n{log[-6000:]}"
    p = run([CXX, "-shared", *EXTRA_FLAGS, "-o", str(out / LIB), *map(str, objs)], BUILD_TIMEOUT_S)
    assert p.returncode == 0, f"linking the emulation failed:\n{p.stdout}{p.stderr}"
    deps = {}
    for s, o in zip(sources, objs):
        text = o.with_suffix(".d").read_text().replace("\\\n", " ")
        deps[_name(s)] = text.split(":", 1)[1].split()
    return logs, deps


def _build_key() -> str:
    """Every input of ``_build_into`` but the system headers: the compiler, the flags, the build
    code and every file under csrc/ and tests/simt/."""
    return (Hasher("simt").tool("cxx", CXX).add("flags", (CXX_FLAGS, EXTRA_FLAGS))
            .add("code", inspect.getsource(_compile) + inspect.getsource(_build_into))
            .tree("sources", CSRC, SIMT).environment().hexdigest())


def _read_elsewhere(deps: dict[str, list[str]]) -> dict[str, str | None]:
    """The files the build read outside csrc/ and tests/simt/ (the system headers), with their
    sha256: a cached build is reused only while they are unchanged too."""
    hashed = (CSRC, SIMT.resolve())
    out = {}
    for d in sorted({d for ds in deps.values() for d in ds}):
        p = Path(d).resolve()
        if not any(p.is_relative_to(h) for h in hashed):
            out[d] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
    return out


@pytest.fixture(scope="module")
def build(request, tmp_path_factory) -> Build:
    """The emulation library, built once per test module, or the build of an earlier run whose
    inputs were the same (tests/build_cache.py; only a build that succeeded is kept). A build of
    another source directory (FUSEDOPT_CSRC_DIR) is neither looked up nor stored: the mutants of
    tests/simt_mutations.py would take the places of the real build's entries."""
    out = tmp_path_factory.mktemp("simt")
    cache = Cache(request.config, "simt") if CSRC == DEFAULT_CSRC else None
    key = _build_key()
    start = time.perf_counter()
    if cache is not None and (entry := cache.lookup(key)) is not None:
        meta = json.loads((entry / "build.json").read_text())
        if _read_elsewhere(meta["deps"]) == meta["elsewhere"]:
            shutil.copyfile(entry / LIB, out / LIB)
            print(f"\nSIMT emulation of an earlier run with the same inputs ({entry}; built in "
                  f"{meta['seconds']:.1f} s)")
            return Build(out / LIB, time.perf_counter() - start, meta["logs"], meta["deps"])
        shutil.rmtree(entry, ignore_errors=True)  # a system header changed
    logs, deps = _build_into(out)
    seconds = time.perf_counter() - start
    print(f"\nSIMT emulation of {CSRC} built in {seconds:.1f} s ({len(logs)} sources, 2 at a "
          "time)")
    if cache is not None and _build_key() == key:  # no source changed while it was built
        meta = dict(seconds=seconds, logs=logs, deps=deps, elsewhere=_read_elsewhere(deps))

        def fill(d: Path) -> None:
            shutil.copyfile(out / LIB, d / LIB)
            (d / "build.json").write_text(json.dumps(meta))

        cache.store(key, fill)
    return Build(out / LIB, seconds, logs, deps)


# ------------------------------------------------------------------------- ctypes mirrors

class BucketPtrs(ctypes.Structure):
    _fields_ = [("n", ctypes.c_int64), ("numel", ctypes.c_void_p), ("weights", ctypes.c_void_p),
                ("weight_dtype", ctypes.c_int32), ("grads", ctypes.c_void_p),
                ("grad_dtype", ctypes.c_int32), ("state1", ctypes.c_void_p),
                ("state2", ctypes.c_void_p), ("params", ctypes.c_void_p),
                ("param_dtype", ctypes.c_int32), ("steps", ctypes.c_void_p),
                ("formats", ctypes.c_void_p), ("keys", ctypes.c_void_p)]


def _c_fields(cls) -> list:
    """The members of math.h's struct for the dataclass ``cls``: its fields in order (Note [hyper
    fields] in csrc/cpu/ops.h), booleans as bool, every other field a double."""
    return [(f.name, ctypes.c_bool if f.type == "bool" else ctypes.c_double)
            for f in dataclasses.fields(cls)]


class LambHyperC(ctypes.Structure):
    _fields_ = _c_fields(_hyper.LambHyper)


class LarsHyperC(ctypes.Structure):
    _fields_ = _c_fields(_hyper.LarsHyper)


class DeviceScalarsC(ctypes.Structure):
    _fields_ = [("grad_mult", ctypes.c_void_p), ("found_inf", ctypes.c_void_p),
                ("lr", ctypes.c_void_p)]


def _mirror_layout() -> list[int]:
    """sizeof/offsetof in the order of simt_layout (tests/simt/driver.cpp)."""
    out = []
    for cls in (BucketPtrs, LambHyperC, LarsHyperC, DeviceScalarsC):
        out.append(ctypes.sizeof(cls))
        out += [getattr(cls, name).offset for name, _ in cls._fields_]
    return out + [4, ctypes.sizeof(ctypes.c_bool)]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _ptr_array(ts):
    return None if ts is None else (ctypes.c_void_p * len(ts))(*[t.data_ptr() for t in ts])


class KernelError(AssertionError):
    pass


class Emu:
    """The launchers of csrc/cuda/launch.h and the scheduler's knobs, from Python."""

    def __init__(self, path: Path):
        lib = self.lib = ctypes.CDLL(str(path))
        P, I32, I64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
        sigs = {
            "simt_launch_sq_norms": ([I64, P, P, I32, P, P], ctypes.c_int),
            "simt_launch_lamb_pass1": ([P, P, P, P, P], ctypes.c_int),
            "simt_launch_lamb_pass2": ([P, P, P, P], ctypes.c_int),
            "simt_launch_lars_pass1": ([P, P, P, P, P], ctypes.c_int),
            "simt_launch_lars_pass2": ([P, P, P, P], ctypes.c_int),
            "simt_error_string": ([ctypes.c_int], ctypes.c_char_p),
            "simt_unsupported_dtypes": ([P], ctypes.c_char_p),
            "simt_chunk_size": ([], I64),
            "simt_total_chunks": ([I64, P], I64),
            "simt_table_capacity": ([I32], I32),
            "simt_layout": ([P, I32], I32),
            "simt_set_schedule": ([I32, I32, ctypes.c_uint64], None),
            "simt_reset_stats": ([], None),
            "simt_stats": ([P], None),
            "simt_launch_log": ([], ctypes.c_char_p),
            "simt_fault_message": ([], ctypes.c_char_p),
            "simt_selftest": ([ctypes.c_char_p, P, P, ctypes.c_uint, ctypes.c_uint], ctypes.c_int),
        }
        for conv in ("half_to_float", "float_to_half", "bfloat16_to_float", "float_to_bfloat16"):
            sigs[f"simt_{conv}"] = ([P, P, I64], None)
        for name, (args, res) in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        self.chunk_size = lib.simt_chunk_size()

    # ---- scheduler
    def schedule(self, threads=WARP_SKEW, blocks=FORWARD, seed=0):
        """The orders of the next launches. The default, warp-skewed, runs warp 0 alone up to
        each __syncthreads, its lanes from the last: a barrier missing between a write to shared
        memory and the reads of other threads (block_sum's exchange between warps,
        block_broadcast's from thread 0) then changes what the readers see. The round-robin orders
        release every shuffle at the end of a round, in which every warp has run, and hide the
        first of those."""
        self.lib.simt_set_schedule(threads, blocks, seed)

    def reset_stats(self):
        self.lib.simt_reset_stats()

    def stats(self) -> dict[str, int]:
        out = (ctypes.c_int64 * 6)()
        self.lib.simt_stats(out)
        names = ("launches", "blocks", "threads", "resumes", "block_barriers", "warp_shuffles")
        return dict(zip(names, out))

    def launches(self) -> list[tuple[str, int, int]]:
        """(kernel, grid.x, block.x) of every launch since reset_stats()."""
        out = []
        for line in self.lib.simt_launch_log().decode().splitlines():
            name, grid, block = line.rsplit(" ", 2)
            out.append((name, int(grid[5:].split("x")[0]), int(block[6:].split("x")[0])))
        return out

    def fault(self) -> str:
        return self.lib.simt_fault_message().decode()

    def check(self, rc: int, what: str):
        if rc != 0:
            raise KernelError(f"{what}: error {rc} ({self.lib.simt_error_string(rc).decode()}) "
                              f"{self.fault()}")

    # ---- launchers
    def total_chunks(self, numel: list[int]) -> int:
        return self.lib.simt_total_chunks(len(numel), (ctypes.c_int64 * len(numel))(*numel))

    def workspace(self, numel, k, dtype):
        # NaN: a row the reduction read but no chunk block wrote would show in the sums
        return torch.full((max(self.total_chunks(numel), 1), k), math.nan, dtype=dtype)

    def sq_norms(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        dtype = tensors[0].dtype
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        numel = [t.numel() for t in tensors]
        out = torch.full((len(tensors),), math.nan, dtype=compute)
        partials = self.workspace(numel, 1, compute)
        rc = self.lib.simt_launch_sq_norms(len(tensors), (ctypes.c_int64 * len(numel))(*numel),
                                           _ptr_array(tensors), DTYPE_CODE[dtype], out.data_ptr(),
                                           partials.data_ptr())
        self.check(rc, "launch_sq_norms")
        return out

    def run_pass(self, name: str, b: "Lists", hyper, scalars, sums=None):
        keep = []
        bp = b.ptrs(keep)
        if name.endswith("pass1"):
            sums = torch.full((b.n, 2), math.nan, dtype=b.compute)
            partials = self.workspace(b.numel, 2, b.compute)
            rc = getattr(self.lib, f"simt_launch_{name}")(
                ctypes.byref(bp), ctypes.byref(hyper), ctypes.byref(scalars), sums.data_ptr(),
                partials.data_ptr())
            self.check(rc, name)
            return sums
        rc = getattr(self.lib, f"simt_launch_{name}")(ctypes.byref(bp), ctypes.byref(hyper),
                                                      ctypes.byref(scalars), sums.data_ptr())
        self.check(rc, name)
        return None


@pytest.fixture(scope="module")
def emu(build) -> Emu:
    e = Emu(build.lib)
    e.schedule()
    return e


@pytest.fixture
def fresh(emu):
    """The emulator with the default (warp-skewed) schedule and cleared counters, restored
    afterwards."""
    emu.schedule()
    emu.reset_stats()
    yield emu
    emu.schedule()


# ------------------------------------------------------------------------------- tensors

GUARD = -77.0  # exact in every dtype


class Arena:
    """Each tensor is a view into a larger buffer, with guard elements before and after it; its
    data pointer is 16-byte aligned or (misaligned) one element past a 16-byte boundary."""

    def __init__(self):
        self.buffers: list[tuple[torch.Tensor, int, int]] = []

    def place(self, src: torch.Tensor, misalign: bool) -> torch.Tensor:
        es = src.element_size()
        lead = 2 * 16 // es + (1 if misalign else 0)
        n = src.numel()
        buf = torch.full((lead + n + 2 * 16 // es + 1,), GUARD, dtype=src.dtype)
        view = buf[lead:lead + n].view(src.shape)
        view.copy_(src)
        if n > 0:  # torch reports no data pointer of its own for a 0-size view
            aligned = view.data_ptr() % 16 == 0
            assert aligned != misalign, "the arena did not place the tensor as asked"
        self.buffers.append((buf, lead, n))
        return view

    def check_guards(self):
        for buf, lead, n in self.buffers:
            outside = torch.cat([buf[:lead], buf[lead + n:]])
            assert torch.equal(outside, torch.full_like(outside, GUARD)), \
                f"a kernel wrote outside a tensor of {n} elements ({buf.dtype})"


@dataclass
class Lists:
    """The lists of one bucket (BucketPtrs), holding the tensors."""
    weights: list
    grads: list | None
    state1: list | None
    state2: list | None
    params: list | None
    steps: list
    grad_dtype: torch.dtype | None = None
    formats: list | None = None  # BucketPtrs.formats (StateFormat per tensor; None: nullptr)
    keys: list | None = None     # BucketPtrs.keys (None: nullptr)

    @property
    def n(self):
        return len(self.weights)

    @property
    def numel(self):
        return [w.numel() for w in self.weights]

    @property
    def compute(self):
        return torch.float64 if self.weights[0].dtype == torch.float64 else torch.float32

    def ptrs(self, keep: list) -> BucketPtrs:
        """The BucketPtrs of these lists; `keep` holds the arrays it points into."""
        arrays = [(ctypes.c_int64 * self.n)(*self.numel), _ptr_array(self.weights),
                  _ptr_array(self.grads), _ptr_array(self.state1), _ptr_array(self.state2),
                  _ptr_array(self.params), _ptr_array(self.steps),
                  None if self.formats is None else (ctypes.c_uint8 * self.n)(*self.formats),
                  None if self.keys is None else (ctypes.c_int64 * self.n)(*self.keys)]
        keep += arrays
        addr = [None if a is None else ctypes.addressof(a) for a in arrays]
        wd = DTYPE_CODE[self.weights[0].dtype]
        return BucketPtrs(
            n=self.n, numel=addr[0], weights=addr[1], weight_dtype=wd, grads=addr[2],
            grad_dtype=DTYPE_CODE[self.grad_dtype] if self.grads is not None else wd,
            state1=addr[3], state2=addr[4], params=addr[5],
            param_dtype=DTYPE_CODE[self.params[0].dtype] if self.params is not None else wd,
            steps=addr[6], formats=addr[7], keys=addr[8])


def lamb_hyper(group: dict, lr) -> LambHyperC:
    h = _hyper.lamb_hyper({**_hyper.LAMB_DEFAULTS, **group, "lr": lr})
    return LambHyperC(**{name: _c_value(getattr(h, name)) for name, _ in LambHyperC._fields_})


def lars_hyper(group: dict, lr) -> LarsHyperC:
    h = _hyper.lars_hyper({**_hyper.LARS_DEFAULTS, **group, "lr": lr})
    return LarsHyperC(**{name: _c_value(getattr(h, name)) for name, _ in LarsHyperC._fields_})


def _c_value(v):
    return math.nan if v is None else v


def _scalar(value, dtype):
    return None if value is None else torch.tensor(value, dtype=dtype)


# ------------------------------------------------------------------------------- the runs

LISTS = ("param", "master", "grad", "state1", "state2")  # the roles of run_case's tensors


def _layout(name: str):
    """Which tensors start one element past a 16-byte boundary: (index, role) -> bool.
    "only_<role>": every tensor of that list, and nothing else."""
    if name.startswith("only_"):
        role = name[len("only_"):]
        assert role in LISTS, name
        return lambda i, r: r == role
    return {
        "aligned": lambda i, role: False,
        "misaligned": lambda i, role: True,
        "mixed": lambda i, role: i % 3 == 1,
        "neighbours": lambda i, role: i != 0,  # tensor 0 aligned among misaligned ones
        "one_list": lambda i, role: role in ("state1", "grad"),  # vectors for w, not for m / g
    }[name]


@dataclass
class Case:
    kind: str                        # "lamb" or "lars"
    shapes: list
    hyper: dict = field(default_factory=dict)  # docs/math.md names (fusedopt.testing.OPTION_CASES)
    dtype: torch.dtype = torch.float32         # of the params
    grad_dtype: torch.dtype | None = None      # default: the params'
    masters: bool = False            # fp32 master weights beside bf16/fp16 params
    steps: int = 3
    seed: int = 0
    zero_weight: int | None = None
    zero_grad: int | None = None
    grad_mult: float | None = None   # DeviceScalars.grad_mult (None: nullptr)
    lr_tensor: bool = False          # lr in DeviceScalars.lr, the hyper's lr set to a wrong value
    found_inf: list | None = None    # per step: None (nullptr) or the found_inf value
    layout: str = "mixed"
    kernel_hyper: dict = field(default_factory=dict)  # given to the kernels only, over `hyper`


@dataclass
class Run:
    case: Case
    params: list
    masters: list | None
    weights: list
    state1: list
    state2: list | None
    steps: list
    ref: object
    ref_w: list
    arena: Arena
    sums: list = field(default_factory=list)       # pass 1's sums, per step
    expected: list = field(default_factory=list)   # float64 recomputation, per step
    snapshots: list = field(default_factory=list)  # every tensor after each step

    def tensors(self):
        out = list(self.params) + list(self.masters or []) + list(self.state1) + \
            list(self.state2 or []) + list(self.steps)
        return [t.clone() for t in out]


def _expected_lamb_sums(group, w, m, v, t):
    """(|w|^2, |u|^2) in float64 from the stored w and the m, v and step pass 1 left."""
    h = {**_hyper.LAMB_DEFAULTS, **group}
    b1, b2 = h["betas"]
    r1 = 1.0 / (1.0 - b1 ** t) if h["bias_correction"] else 1.0
    r2 = 1.0 / math.sqrt(1.0 - b2 ** t) if h["bias_correction"] else 1.0
    lam = 0.0 if h["decoupled_weight_decay"] else h["weight_decay"]
    w, m, v = w.double(), m.double(), v.double()
    u = m * r1 / (v.sqrt() * r2 + h["eps"]) + lam * w
    return [(w * w).sum(), (u * u).sum()]


def _expected_lars_sums(group, w, g):
    h = {**_hyper.LARS_DEFAULTS, **group}
    w = w.double()
    d = g + h["weight_decay"] * w if h["denominator"] == "combined" else g
    return [(w * w).sum(), (d * d).sum()]


def run_case(emu: Emu, case: Case) -> Run:
    """``case.steps`` steps of pass 1 then pass 2, with the initial values and gradients of
    fusedopt.testing.run_backend (same seeds), and the float64 reference stepped beside."""
    lamb = case.kind == "lamb"
    compute = torch.float64 if case.dtype == torch.float64 else torch.float32
    grad_dtype = case.grad_dtype or case.dtype
    lr = LR[case.kind]
    mis = _layout(case.layout)
    arena = Arena()
    init = make_tensors(case.shapes, torch.float64, case.seed, zero_weight=case.zero_weight)
    params = [arena.place(t.to(case.dtype), mis(i, "param")) for i, t in enumerate(init)]
    masters = ([arena.place(p.float(), mis(i, "master")) for i, p in enumerate(params)]
               if case.masters else None)
    weights = masters if masters is not None else params
    zeros = [torch.zeros(s, dtype=compute) for s in case.shapes]
    grads = [arena.place(torch.zeros(s, dtype=grad_dtype), mis(i, "grad"))
             for i, s in enumerate(case.shapes)]
    state1 = [arena.place(z, mis(i, "state1")) for i, z in enumerate(zeros)]
    state2 = [arena.place(z, mis(i, "state2")) for i, z in enumerate(zeros)] if lamb else None
    steps = [arena.place(torch.zeros((), dtype=torch.float32), False) for _ in case.shapes]
    b1 = Lists(weights, grads, state1, state2, None, steps, grad_dtype)
    if lamb:
        b2 = Lists(weights, None, state1, state2, params if masters is not None else None, steps)
    else:
        b2 = Lists(weights, grads, state1, None, params if masters is not None else None, steps,
                   grad_dtype)

    make_hyper = lamb_hyper if lamb else lars_hyper
    hyper = make_hyper({**case.hyper, **case.kernel_hyper}, 123.0 if case.lr_tensor else lr)
    gm = _scalar(case.grad_mult, compute)
    lr_t = _scalar(lr, torch.float64) if case.lr_tensor else None
    gm64 = 1.0 if gm is None else float(gm)  # the value the kernels read
    ref = (ReferenceLAMB if lamb else ReferenceLARS)([{**case.hyper, "lr": lr}])
    ref_w = [p.double().clone() for p in params]  # from the stored (rounded) values
    run = Run(case, params, masters, weights, state1, state2, steps, ref, ref_w, arena)

    gen = torch.Generator().manual_seed(case.seed + 1)
    for step in range(case.steps):
        g64 = []
        for i, s in enumerate(case.shapes):
            gr = torch.randn(s, generator=gen, dtype=torch.float64)
            if case.zero_grad is not None and i == case.zero_grad:
                gr.zero_()
            grads[i].copy_(gr.to(grad_dtype))
            g64.append(grads[i].double() * gm64)
        given = [g.clone() for g in grads]
        fi_value = None if case.found_inf is None else case.found_inf[step]
        fi = _scalar(fi_value, torch.float32)
        s1 = DeviceScalarsC(_ptr(gm), _ptr(fi), None)
        s2 = DeviceScalarsC(_ptr(gm), _ptr(fi), _ptr(lr_t))
        w_before = [w.clone() for w in weights]
        sums = emu.run_pass(f"{case.kind}_pass1", b1, hyper, s1)
        if lamb:
            expected = [_expected_lamb_sums(case.hyper, w, m, v, float(t))
                        for w, m, v, t in zip(w_before, state1, state2, steps)]
        else:
            expected = [_expected_lars_sums(case.hyper, w, g) for w, g in zip(w_before, g64)]
        emu.run_pass(f"{case.kind}_pass2", b2, hyper, s2, sums)
        assert_bitwise(grads, given, "grads (read-only)")
        if not fi_value:
            ref.step([ref_w], [g64])
        run.sums.append(sums)
        run.expected.append(torch.tensor(expected, dtype=torch.float64).reshape(-1, 2))
        run.snapshots.append(run.tensors())
    arena.check_guards()
    return run


# ---------------------------------------------------------------------------- the checks

def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max|got - ref| / max|ref| (0 for 0-size tensors), NaN-aware (NaN: inf)."""
    if got.numel() == 0:
        return 0.0
    d = (got.double() - ref).abs().max().item()
    if math.isnan(d):
        return math.inf
    return d / (ref.abs().max().item() or 1.0)


def ref_states(run: Run):
    keys = ("exp_avg", "exp_avg_sq") if run.case.kind == "lamb" else ("momentum_buffer",)
    lists = [run.state1] + ([run.state2] if run.state2 is not None else [])
    return [(key, i, got, run.ref.state[(0, i)][key])
            for key, mine in zip(keys, lists) for i, got in enumerate(mine)]


def check_against_reference(run: Run, *, eager_params=None):
    """The step counts; pass 1's sums of every step against their float64 recomputation; the
    weights (fp32/fp64 params or fp32 masters) and the optimizer states against the float64
    reference at the C++ backend's tolerances; params beside masters equal to their masters
    rounded; bf16/fp16 params without masters within rounding of the eager backend's
    (``eager_params``), as in test_cpp.test_low_precision_within_rounding."""
    case = run.case
    compute = torch.float64 if case.dtype == torch.float64 else torch.float32
    tol = TOL[compute]
    done = sum(1 for k in range(case.steps) if not (case.found_inf and case.found_inf[k]))
    for t in run.steps:
        assert t.item() == done, f"step count {t.item()}, expected {done}"
    for k, (sums, exp) in enumerate(zip(run.sums, run.expected)):
        if case.found_inf and case.found_inf[k]:
            continue
        torch.testing.assert_close(sums.double(), exp, rtol=SUM_RTOL[compute], atol=1e-30,
                                   msg=lambda m: f"pass-1 sums of step {k}: {m}")
    low_no_masters = case.dtype in (torch.bfloat16, torch.float16) and not case.masters
    if not low_no_masters:
        errs = [rel_err(w, r) for w, r in zip(run.weights, run.ref_w)]
        assert max(errs) <= tol, f"weights off the float64 reference: {max(errs):.3g} > {tol}"
    for key, i, got, want in ref_states(run):
        if low_no_masters and key == "momentum_buffer":
            continue  # depends on the rounded weights: covered by the params' check below
        err = rel_err(got, want)
        assert err <= tol, f"{key}[{i}] off the float64 reference: {err:.3g} > {tol}"
    if case.masters:  # the params are their masters rounded to nearest even
        for p, m in zip(run.params, run.masters):
            assert torch.equal(p, m.to(p.dtype))
    if low_no_masters:
        assert eager_params is not None
        assert_within_rounding(run.params, eager_params, run.ref_w, LOW_ATOL[case.dtype])


def assert_bitwise(a: list, b: list, what="tensors"):
    assert len(a) == len(b)
    for k, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        xb = x.reshape(-1).view(torch.uint8) if x.numel() else x
        yb = y.reshape(-1).view(torch.uint8) if y.numel() else y
        assert torch.equal(xb, yb), f"{what}[{k}] differ bitwise"


def all_outputs(run: Run) -> list:
    return [t for snap in run.snapshots for t in snap] + run.sums


def _eager(case: Case):
    params, _, _ = run_backend(case.kind, "eager", case.shapes, case.hyper, dtype=case.dtype,
                               grad_dtype=case.grad_dtype, steps=case.steps, seed=case.seed,
                               zero_weight=case.zero_weight, zero_grad=case.zero_grad,
                               master_weights=False)
    return params


# ============================================================================ the emulator

@pytest.mark.build
def test_emulation_builds_without_warnings(build):
    noisy = {name: log for name, log in build.logs.items() if "warning" in log}
    assert not noisy, "\n".join(f"{name}:\n{log[-3000:]}" for name, log in noisy.items())


def test_no_toolkit_header_is_read(build):
    """Every CUDA header the build read is the emulation's (tests/simt/include)."""
    include = (SIMT / "include").resolve()
    seen = set()
    for source, deps in build.deps.items():
        for d in deps:
            p = Path(d).resolve()
            if include in p.parents:
                seen.add(p.name)
            elif ROOT.resolve() not in p.parents and CSRC not in p.parents:  # a system header
                assert not p.name.startswith("cuda") and "cuda" not in str(p).lower(), \
                    f"{source} read {p}, a toolkit header"
    assert {"cuda_runtime.h", "cuda_runtime_api.h", "cuda_fp16.h", "cuda_bf16.h"} <= seen


def test_real_sources_are_built(build):
    """The .cu files compiled are csrc's own (not copies; or those of FUSEDOPT_CSRC_DIR), with
    the headers they include."""
    for src in CUDA_SOURCES:
        deps = [Path(d).resolve() for d in build.deps[_name(src)]]
        assert src.resolve() in deps
        for header in ("cuda/multi_tensor_apply.cuh", "cuda/launch.h", "fusedopt/math.h"):
            assert (CSRC / header).resolve() in deps


def test_struct_layouts_match_the_driver(emu):
    out = (ctypes.c_int64 * 64)()
    n = emu.lib.simt_layout(out, 64)
    assert list(out[:n]) == _mirror_layout()


def _float_probes() -> torch.Tensor:
    """float32 values around every rounding decision of bf16 and fp16: for each pattern of the
    high bits, the low bits at 0, 1, just under, at and just over the halfway point, and all
    ones; plus random bit patterns, infinities, NaNs, zeros and the subnormals."""
    hi = torch.arange(1 << 16, dtype=torch.int64)
    low16 = torch.tensor([0, 1, 0x7fff, 0x8000, 0x8001, 0xffff], dtype=torch.int64)
    bf = (hi[:, None] << 16 | low16[None, :]).reshape(-1)
    # fp16 keeps 10 mantissa bits: the rounding point is bit 12 for normal halves, higher below
    exps = torch.arange(90, 145, dtype=torch.int64)  # float exponents around fp16's range
    mant_hi = torch.arange(1 << 10, dtype=torch.int64) << 13
    rest = torch.tensor([0, 1, 0xfff, 0x1000, 0x1001, 0x1fff, 0x0800, 0x17ff], dtype=torch.int64)
    fp = ((exps[:, None, None] << 23) | mant_hi[None, :, None] | rest[None, None, :]).reshape(-1)
    sub = torch.arange(0, 1 << 12, dtype=torch.int64) << 11  # float subnormals and tiny values
    g = torch.Generator().manual_seed(0)
    rnd = torch.randint(0, 1 << 32, (1 << 20,), generator=g, dtype=torch.int64)
    special = torch.tensor([0x7f800000, 0x7fc00000, 0x7f800001, 0x7fffffff, 0x477fe000,
                            0x477fefff, 0x477ff000, 0x33000000, 0x33000001, 0x387fe000],
                           dtype=torch.int64)
    u = torch.cat([bf, fp, sub, rnd, special]) & 0xffffffff
    u = torch.cat([u, u | 0x80000000])  # both signs
    return (u - ((u >> 31) << 32)).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("dtype,to_f,from_f", [
    (torch.float16, "half_to_float", "float_to_half"),
    (torch.bfloat16, "bfloat16_to_float", "float_to_bfloat16")], ids=["fp16", "bf16"])
def test_conversions_match_torch(emu, dtype, to_f, from_f):
    """The emulated __float2half_rn / __float2bfloat16_rn round to nearest even as torch does
    (NaN stays NaN), and __half2float / __bfloat162float are exact, for every 16-bit value."""
    x = _float_probes()
    got = torch.empty(x.numel(), dtype=torch.int16)
    getattr(emu.lib, f"simt_{from_f}")(x.data_ptr(), got.data_ptr(), x.numel())
    want = x.to(dtype)
    nan = want.isnan()
    assert torch.equal(got.view(dtype).isnan(), nan)
    bad = (got != want.view(torch.int16)) & ~nan
    assert not bad.any(), (f"{int(bad.sum())} roundings differ from torch, e.g. "
                           f"{x[bad][:4].tolist()} -> {got[bad][:4].tolist()} "
                           f"vs {want.view(torch.int16)[bad][:4].tolist()}")
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    back = torch.empty(every.numel(), dtype=torch.float32)
    getattr(emu.lib, f"simt_{to_f}")(every.data_ptr(), back.data_ptr(), every.numel())
    want = every.view(dtype).float()
    nan = want.isnan()
    assert torch.equal(back.isnan(), nan)
    assert torch.equal(back[~nan].view(torch.int32), want[~nan].view(torch.int32))


def _selftest(emu, which, n, grid, block, dtype=torch.int32, extra=None):
    out = torch.full((n,), -1, dtype=dtype)
    rc = emu.lib.simt_selftest(which.encode(), out.data_ptr(), _ptr(extra), grid, block)
    return rc, out


def test_shuffle_down_semantics(fresh):
    rc, out = _selftest(fresh, "shuffle", 5 * 96 * 2, 2, 96)
    assert rc == 0, fresh.fault()
    out = out.view(2, 96, 5)
    for b in range(2):
        for t in range(96):
            lane, v = t % 32, 1000 * b + t
            want = [v + d if lane + d < 32 else v for d in (1, 5, 16, 31)]
            want.append(v + 3 if lane % 8 + 3 < 8 else v)
            assert out[b, t].tolist() == want, (b, t)
    assert fresh.stats()["warp_shuffles"] == 2 * 3 * 5


# (threads, blocks): every thread order, with every block order
ORDERS = [(FORWARD, FORWARD), (REVERSE, REVERSE), (RANDOM, RANDOM), (WARP_SKEW, REVERSE),
          (WARP_SKEW_RANDOM, RANDOM)]


@pytest.mark.parametrize("threads", [512, 256])
def test_block_sum_and_broadcast(fresh, threads):
    """block_sum and block_broadcast of multi_tensor_apply.cuh, over several blocks (the
    __shared__ arrays are reused from block to block), in every scheduling order."""
    for order, block_order in ORDERS:
        fresh.schedule(order, block_order, seed=3)
        rc, out = _selftest(fresh, f"block_sum_{threads}", 6, 3, threads, torch.float64)
        assert rc == 0, fresh.fault()
        for b in range(3):
            v = torch.arange(threads, dtype=torch.float64) + 1000.0 * b
            assert out[2 * b].item() == (v + 1).sum().item()
            assert out[2 * b + 1].item() == (v * v).sum().item()
        rc, out = _selftest(fresh, "broadcast", 3 * threads, 3, threads)
        assert rc == 0, fresh.fault()
        assert torch.equal(out.view(3, threads),
                           torch.tensor([3, 10, 17], dtype=torch.int32)[:, None].expand(3, threads))


def test_scheduling_orders(fresh):
    """The knobs of the determinism tests do change the order threads and blocks run in; the
    warp-skewed orders run one warp at a time."""
    runs = {}
    for name, order, block_order, seed in (
            ("forward", FORWARD, FORWARD, 0), ("reverse", REVERSE, REVERSE, 0),
            ("random1", RANDOM, RANDOM, 1), ("random2", RANDOM, RANDOM, 2),
            ("skew", WARP_SKEW, FORWARD, 0), ("skew_random", WARP_SKEW_RANDOM, FORWARD, 1)):
        fresh.schedule(order, block_order, seed)
        count = torch.zeros(1, dtype=torch.int32)
        rc, out = _selftest(fresh, "order", 4 * 64, 4, 64, extra=count)
        assert rc == 0 and count.item() == 256
        assert sorted(out.tolist()) == list(range(256))
        runs[name] = out.tolist()
    assert runs["forward"] == list(range(256))
    assert runs["reverse"] == [b * 64 + t for b in range(3, -1, -1) for t in range(63, -1, -1)]
    assert runs["skew"] == [b * 64 + w * 32 + lane for b in range(4) for w in range(2)
                            for lane in range(31, -1, -1)]
    warps = [{t // 32 for t in runs["skew_random"][k:k + 32]} for k in range(0, 256, 32)]
    assert all(len(w) == 1 for w in warps), "a warp-skewed order interleaved two warps"
    assert sorted(w.pop() for w in warps) == list(range(8))
    assert len({tuple(r) for r in runs.values()}) == 6


def test_resume_order_exposes_a_shared_memory_race(fresh):
    """A kernel with a race gives different results under different resume orders: the
    determinism tests below can fail."""
    results = set()
    for order in (FORWARD, REVERSE):
        fresh.schedule(order, FORWARD)
        rc, out = _selftest(fresh, "race", 64, 1, 64)
        assert rc == 0, fresh.fault()
        results.add(tuple(out.tolist()))
    assert len(results) == 2


def test_warp_skew_exposes_missing_barriers(fresh):
    """block_sum's exchange between warps and block_broadcast, each without its __syncthreads
    (selftest.cpp): under the round-robin orders warp 0 reads the other warps' values after a
    shuffle, which is released only at the end of a round in which every warp has written, and
    under the forward order thread 0 writes before the others read; the warp-skewed order, that of
    the optimizer tests, shows both: what is read is the previous block's value."""
    blocks, threads = 3, 128
    want = torch.zeros(blocks, 32, dtype=torch.int32)
    for b in range(blocks):
        want[b, :threads // 32] = torch.arange(threads // 32) + 1000 * b + 1
    for order in (FORWARD, REVERSE, RANDOM, WARP_SKEW):
        fresh.schedule(order, FORWARD, seed=5)
        rc, out = _selftest(fresh, "unsynced_sum", blocks * 32, blocks, threads)
        assert rc == 0, fresh.fault()
        out = out.view(blocks, 32)
        if order == WARP_SKEW:
            assert torch.equal(out[:, 0], want[:, 0])  # its own warp's value, written before
            assert (out[:, 1:threads // 32] != want[:, 1:threads // 32]).all()
        else:
            assert torch.equal(out, want), order
    want = (7 * torch.arange(blocks, dtype=torch.int32) + 3)[:, None].expand(blocks, threads)
    for order in (FORWARD, WARP_SKEW):
        fresh.schedule(order, FORWARD)
        rc, out = _selftest(fresh, "unsynced_broadcast", blocks * threads, blocks, threads)
        assert rc == 0, fresh.fault()
        wrong = out.view(blocks, threads) != want
        if order == WARP_SKEW:  # lanes 31 .. 1 of warp 0 read before thread 0 wrote
            assert wrong[:, 1:32].all() and not wrong[:, 0].any() and not wrong[:, 32:].any()
        else:
            assert not wrong.any()


def _aligned_bytes(n: int) -> torch.Tensor:
    raw = torch.zeros(n + 64, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % 64
    return raw[shift:shift + n]


def _line_of(header: str, text: str) -> str:
    """file:line of the one line of csrc/cuda/<header> that holds ``text``."""
    lines = [n for n, line in enumerate((CSRC / "cuda" / header).read_text().splitlines(), 1)
             if text in line]
    assert len(lines) == 1, (header, text, lines)
    return f"{header}:{lines[0]}"


@pytest.mark.parametrize("which,size,access", [
    ("vector_access", 16, ("multi_tensor_apply.cuh", "const V pk = q[u];")),
    ("vector_store", 16, ("multi_tensor_apply.cuh", "q[u] = pk;")),
    ("codes_access", 8, ("lowp.cuh", "*reinterpret_cast<const Codes8<C>*>(p + off)"))])
def test_a_misaligned_vector_access_is_a_fault(fresh, which, size, access):
    """The kernels' vector accesses (load_group / store_group: 16 bytes; load_codes /
    store_codes: 8 bytes) through a pointer that is not a multiple of their size stop the launch
    with cudaErrorMisalignedAddress before anything is written, as on the device; aligned, they
    do what they should."""
    threads = 64
    elem = 1 if which == "codes_access" else 4  # float or 8-bit code
    buf = _aligned_bytes(threads * size + size)
    for offset in range(0, size, elem):
        view = buf[offset:offset + threads * size]
        dtype = torch.int8 if elem == 1 else torch.float32
        init = torch.arange(threads * size // elem, dtype=torch.int32).to(dtype)
        data = view.view(dtype)
        data.copy_(init)
        rc = fresh.lib.simt_selftest(which.encode(), data.data_ptr(), None, 1, threads)
        if offset == 0:
            assert rc == 0, fresh.fault()
            want = {"vector_access": init * 2, "vector_store": init + 1,
                    "codes_access": init + 1}[which]
            assert torch.equal(data, want)
        else:
            assert rc == MISALIGNED, (offset, rc, fresh.fault())
            fault = fresh.fault()
            assert "misaligned address" in fault and f"({_line_of(*access)})" in fault, fault
            assert f"{offset} bytes past a {size}-byte boundary" in fault, fault
            assert torch.equal(data, init)


@pytest.mark.parametrize("which,message", [
    ("divergent_barrier", "thread 3 exited"),
    ("two_barriers", "different __syncthreads"),
    ("partial_shuffle", "__shfl_down_sync"),
])
def test_barrier_misuse_is_a_launch_failure(fresh, which, message):
    rc, _ = _selftest(fresh, which, 64, 1, 64)
    assert rc == LAUNCH_FAILURE
    assert message in fresh.fault()


# ======================================================================= the optimizer kernels

# (4101,): more than 8 * 480 elements, so that even with 8-element groups (a 2-byte array: Note
# [vectorization]) every warp of its chunk block holds a share of its sums, and a block reduction
# that lost a warp's share changes its trust ratio.
SHAPES = [(3, 5), (7,), (0,), (1,), (33,), (2, 3, 4), (4101,), (16,)]
ZERO_WEIGHT, ZERO_GRAD = 7, 5

# the option cases without max_grad_norm (the clipping divisor is grad_mult here: see below),
# but "default": test_dtypes' fp32 rows run it
LAMB_FLAG_CASES = {k: v for k, v in option_cases("lamb").items()
                   if "max_grad_norm" not in v and k != "default"}
LAMB_FLAG_CASES["bounds_clamped"] = dict(trust_ratio_bounds=(1.5, 2.0))
LAMB_FLAG_CASES["decoupled_no_bias_correction"] = dict(decoupled_weight_decay=True,
                                                       weight_decay=0.1, bias_correction=False)
LARS_FLAG_CASES = {k: v for k, v in option_cases("lars").items()
                   if "max_grad_norm" not in v and k != "default"}
LARS_FLAG_CASES["combined_trust_clip_nesterov"] = dict(denominator="combined", trust_clip=True,
                                                       trust_coefficient=1.0, nesterov=True,
                                                       weight_decay=1e-2)


@pytest.mark.parametrize("name", list(LAMB_FLAG_CASES))
def test_lamb_flags(fresh, name):
    hyper = LAMB_FLAG_CASES[name]
    run = run_case(fresh, Case("lamb", SHAPES, hyper, zero_weight=ZERO_WEIGHT, zero_grad=ZERO_GRAD))
    check_against_reference(run)


@pytest.mark.parametrize("name", list(LARS_FLAG_CASES))
def test_lars_flags(fresh, name):
    run = run_case(fresh, Case("lars", SHAPES, LARS_FLAG_CASES[name], zero_weight=ZERO_WEIGHT,
                               zero_grad=ZERO_GRAD))
    check_against_reference(run)


DTYPE_CONFIGS = [  # (params, masters, grads): every combination dispatch_grad accepts
    (torch.float32, False, torch.float32), (torch.float32, False, torch.bfloat16),
    (torch.float32, False, torch.float16), (torch.float64, False, torch.float64),
    (torch.bfloat16, False, torch.bfloat16), (torch.bfloat16, False, torch.float32),
    (torch.bfloat16, True, torch.bfloat16), (torch.bfloat16, True, torch.float32),
    (torch.float16, False, torch.float16), (torch.float16, False, torch.float32),
    (torch.float16, True, torch.float16), (torch.float16, True, torch.float32),
]
_NAMES = {torch.float32: "fp32", torch.float64: "fp64", torch.bfloat16: "bf16",
          torch.float16: "fp16"}


def _dtype_id(cfg):
    p, m, g = cfg
    return f"{_NAMES[p]}{'_masters' if m else ''}_grads_{_NAMES[g]}"


@pytest.mark.parametrize("cfg", DTYPE_CONFIGS, ids=_dtype_id)
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_dtypes(fresh, kind, cfg):
    dtype, masters, grad_dtype = cfg
    hyper = {"lamb": {}, "lars": dict(weight_decay=1e-4)}[kind]
    case = Case(kind, SHAPES, hyper, dtype=dtype, grad_dtype=grad_dtype, masters=masters, steps=4,
                zero_weight=ZERO_WEIGHT, zero_grad=ZERO_GRAD)
    run = run_case(fresh, case)
    low = dtype in (torch.bfloat16, torch.float16) and not masters
    check_against_reference(run, eager_params=_eager(case) if low else None)


@pytest.mark.parametrize("grad_mult", [0.5, 1.0 / 3.0], ids=["half", "third"])
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_grad_mult(fresh, kind, grad_mult):
    """DeviceScalars.grad_mult: every g is read as g * grad_mult, in pass 1 and LARS's pass 2."""
    hyper = {"lamb": {}, "lars": dict(weight_decay=1e-4)}[kind]
    run = run_case(fresh, Case(kind, SHAPES, hyper, grad_mult=grad_mult, zero_weight=ZERO_WEIGHT))
    check_against_reference(run)


@pytest.mark.parametrize("masters", [False, True], ids=["fp32", "bf16_masters"])
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_found_inf(fresh, kind, masters):
    """A nonzero found_inf changes nothing (steps not advanced); zero steps normally, as with no
    found_inf at all, bit for bit."""
    hyper = {"lamb": dict(decoupled_weight_decay=True, weight_decay=0.1),
             "lars": dict(weight_decay=1e-4, lr_in_momentum=False)}[kind]
    dtype = torch.bfloat16 if masters else torch.float32
    base = dict(kind=kind, shapes=SHAPES, hyper=hyper, dtype=dtype, masters=masters,
                grad_mult=0.5, zero_weight=ZERO_WEIGHT)
    run = run_case(fresh, Case(**base, steps=4, found_inf=[0.0, 1.0, math.inf, 0.0]))
    check_against_reference(run)
    for skipped in (1, 2):
        assert_bitwise(run.snapshots[skipped], run.snapshots[0], "state after a skipped step")
    zero = run_case(fresh, Case(**base, steps=2, found_inf=[0.0, 0.0]))
    none = run_case(fresh, Case(**base, steps=2, found_inf=None))
    assert_bitwise(all_outputs(zero), all_outputs(none))


@pytest.mark.parametrize("kind,hyper", [
    ("lamb", dict(decoupled_weight_decay=True, weight_decay=0.1)),
    ("lars", dict(weight_decay=1e-4)),
    ("lars", dict(weight_decay=1e-4, lr_in_momentum=False, dampening=0.3)),
    ("lars", dict(weight_decay=1e-4, nesterov=True))],
    ids=["lamb", "lars", "lars_sgd", "lars_nesterov"])
def test_lr_tensor(fresh, kind, hyper):
    """DeviceScalars.lr replaces the hyper's lr (set to a wrong value here), bit for bit."""
    run = run_case(fresh, Case(kind, SHAPES, hyper, lr_tensor=True))
    check_against_reference(run)
    plain = run_case(fresh, Case(kind, SHAPES, hyper))
    assert_bitwise(all_outputs(run), all_outputs(plain))


def _kernel_launches(emu, kernel):
    return [(g, b) for name, g, b in emu.launches() if kernel in name]


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_more_tensors_than_a_table_holds(fresh, kind):
    """150 tensors: each pass splits into several launches (Note [launch splitting])."""
    shapes = [(0,) if i % 25 == 3 else (1 + (7 * i) % 13,) for i in range(150)]
    hyper = {"lamb": {}, "lars": dict(weight_decay=1e-4)}[kind]
    fresh.reset_stats()
    run = run_case(fresh, Case(kind, shapes, hyper, steps=2, zero_weight=10, zero_grad=11))
    check_against_reference(run)
    rows1, rows2 = {"lamb": (5, 4), "lars": (3, 4)}[kind]
    cap1, cap2 = fresh.lib.simt_table_capacity(rows1), fresh.lib.simt_table_capacity(rows2)
    nonempty = sum(1 for s in shapes if s != (0,))
    tables1, tables2 = math.ceil(150 / cap1), math.ceil(nonempty / cap2)
    assert tables1 >= 2 and tables2 >= 2, "the launch does not split: the test would be vacuous"
    reduce = _kernel_launches(fresh, "reduce_kernel")
    chunk = _kernel_launches(fresh, "chunk_kernel")
    assert len(reduce) == 2 * tables1  # two steps
    assert sum(g for g, _ in reduce) == 2 * 150
    assert len(chunk) == 2 * (tables1 + tables2)
    assert sum(g for g, _ in chunk) == 2 * 2 * nonempty
    assert {b for _, b in reduce} == {256} and {b for _, b in chunk} == {512}


def test_sq_norms_of_more_tensors_than_a_table_holds(fresh):
    """150 tensors: the sums-of-squares pass splits its launches too (a test of its own, apart
    from the step tests, which tests/simt_mutations.py runs without the sums-of-squares pass)."""
    shapes = [(0,) if i % 25 == 3 else (1 + (7 * i) % 13,) for i in range(150)]
    tensors = make_tensors(shapes, torch.float32, 0)
    got = fresh.sq_norms(tensors)
    assert len(_kernel_launches(fresh, "reduce_kernel")) == math.ceil(
        150 / fresh.lib.simt_table_capacity(1)) >= 2
    exact = torch.stack([(t.double() ** 2).sum() for t in tensors])
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=0)


CHUNK = 65536
BOUNDARY_SHAPES = [(CHUNK,), (CHUNK + 1,), (2 * CHUNK + 1,), (5,), (0,)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_chunk_boundaries(fresh, kind, dtype):
    """Tensors ending on, and one past, a chunk boundary; one spanning three chunks."""
    assert fresh.chunk_size == CHUNK
    hyper = {"lamb": {}, "lars": dict(weight_decay=1e-4)}[kind]
    fresh.reset_stats()
    run = run_case(fresh, Case(kind, BOUNDARY_SHAPES, hyper, dtype=dtype, steps=2))
    check_against_reference(run)
    grids = [g for g, _ in _kernel_launches(fresh, "chunk_kernel")]
    assert grids == [1 + 2 + 3 + 1] * 4  # chunks per pass: 65536 -> 1, 65537 -> 2, 2*65536+1 -> 3


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_a_tensor_of_more_chunks_than_a_warp_has_lanes(fresh, kind):
    """34 chunks: reduce_kernel's threads 32 and 33 (warp 1) hold partial rows, so its exchange
    between warps (block_sum) decides the tensor's sums; with 32 chunks or fewer every row is
    warp 0's."""
    shapes = [(3,), (33 * CHUNK + 5,), (7,)]
    assert fresh.total_chunks([33 * CHUNK + 5]) == 34 > 32
    hyper = {"lamb": {}, "lars": dict(weight_decay=1e-4)}[kind]
    run = run_case(fresh, Case(kind, shapes, hyper, steps=1, layout="aligned"))
    check_against_reference(run)


LAYOUT_SHAPES = [(4101,), (CHUNK + 1,), (37,), (8,), (0,), (3,)]


@pytest.mark.parametrize("cfg", [(torch.float32, False), (torch.bfloat16, True),
                                 (torch.float16, False), (torch.float64, False)],
                         ids=["fp32", "bf16_masters", "fp16", "fp64"])
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_alignment_does_not_change_a_bit(fresh, kind, cfg):
    """Note [vectorization]: 16-byte vector accesses (aligned chunks) and element accesses
    (misaligned ones) give the same bits, params, states and pass-1 sums alike, whatever the
    alignment of the tensor and of its neighbours. One list at a time is misaligned too, the
    others aligned (only_<list>): a pointer left out of a chunk's alignment test would send that
    list through the vector path misaligned, which faults (cudaErrorMisalignedAddress)."""
    dtype, masters = cfg
    hyper = {"lamb": {}, "lars": dict(weight_decay=1e-2, denominator="combined")}[kind]
    lists = ["param", "grad", "state1"] + (["state2"] if kind == "lamb" else []) + \
        (["master"] if masters else [])
    layouts = ["aligned", "misaligned", "mixed", "neighbours", "one_list"] + \
        [f"only_{r}" for r in lists]
    runs = {layout: run_case(fresh, Case(kind, LAYOUT_SHAPES, hyper, dtype=dtype, masters=masters,
                                         steps=2, layout=layout))
            for layout in layouts}
    if dtype in (torch.float32, torch.float64) or masters:
        check_against_reference(runs["aligned"])
    for layout, run in runs.items():
        assert_bitwise(all_outputs(run), all_outputs(runs["aligned"]), f"{layout} vs aligned")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16],
                         ids=["fp32", "fp64", "bf16", "fp16"])
def test_sq_norms(fresh, dtype):
    shapes = [(0,), (1,), (CHUNK + 1,), (9, 7), (4101,), (CHUNK,), (2 * CHUNK + 1,)]
    out = {}
    for layout in ("aligned", "mixed"):
        arena = Arena()
        ts = [arena.place(t.to(dtype), _layout(layout)(i, "x"))
              for i, t in enumerate(make_tensors(shapes, torch.float64, 0))]
        got = fresh.sq_norms(ts)
        arena.check_guards()
        assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        exact = torch.stack([(t.double() ** 2).sum() for t in ts])
        rtol = 1e-13 if dtype == torch.float64 else 1e-6
        torch.testing.assert_close(got.double(), exact, rtol=rtol, atol=0)
        out[layout] = got
    assert_bitwise([out["aligned"]], [out["mixed"]])


def test_a_bucket_of_empty_tensors(fresh):
    """Only 0-size tensors: no chunk block at all; the reduction still writes their sums (0)
    and advances their steps."""
    fresh.reset_stats()
    for kind in ("lamb", "lars"):
        run = run_case(fresh, Case(kind, [(0,), (0, 3)], steps=2))
        assert all(t.item() == 2 for t in run.steps)
        assert all(torch.equal(s, torch.zeros_like(s)) for s in run.sums)
    assert not _kernel_launches(fresh, "chunk_kernel")


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_empty_tensors_first_and_last(fresh, kind):
    """0-size tensors before and after the others in a table own no block (slot_of_block must
    never pick them) and still get their sums and steps."""
    shapes = [(0,), (0, 4), (5,), (0,), (9,), (0,)]
    run = run_case(fresh, Case(kind, shapes, {"lamb": {}, "lars": dict(weight_decay=1e-4)}[kind]))
    check_against_reference(run)


@pytest.mark.parametrize("what", ["fp64_weights_fp32_grads", "bf16_params_fp16_grads",
                                  "fp64_with_params", "fp32_params_fp64_grads"])
def test_unsupported_combinations_are_refused(fresh, what):
    """The launchers answer cudaErrorNotSupported to a combination dispatch does not build."""
    t = {d: torch.zeros(4, dtype=d) for d in DTYPE_CODE}
    step = [torch.zeros((), dtype=torch.float32)]
    f64, f32 = [t[torch.float64]], [t[torch.float32]]
    if what == "fp64_weights_fp32_grads":
        b, name = Lists(f64, f32, f64, f64, None, step, torch.float32), "lamb_pass1"
    elif what == "bf16_params_fp16_grads":
        b, name = Lists([t[torch.bfloat16]], [t[torch.float16]], f32, None, None, step,
                        torch.float16), "lars_pass1"
    elif what == "fp64_with_params":
        b, name = Lists(f64, None, f64, f64, [t[torch.bfloat16]], step), "lamb_pass2"
    else:
        b, name = Lists(f32, f64, f32, None, None, step, torch.float64), "lars_pass1"
    hyper = lamb_hyper({}, 0.1) if name.startswith("lamb") else lars_hyper({}, 0.1)
    sums = torch.zeros(1, 2, dtype=b.compute)
    with pytest.raises(KernelError, match=f"error {NOT_SUPPORTED}"):
        fresh.run_pass(name, b, hyper, DeviceScalarsC(None, None, None), sums)


def _binding_refuses(emu, b: "Lists") -> str | None:
    keep = []
    why = emu.lib.simt_unsupported_dtypes(ctypes.byref(b.ptrs(keep)))
    return None if why is None else why.decode()


def test_the_bindings_dtype_check_takes_what_the_backend_accepts(emu):
    """The torch binding's last check of a bucket's dtypes (``unsupported_dtypes`` of
    csrc/cuda/launch.h, called by ``check_supported`` in bindings.cpp) lets through every pass of
    every step the Python backend accepts, as the binding fills its lists: pass 1 gets the
    weights (fp32 masters where kept) and grads, no params; LAMB's pass 2 the weights and params,
    no grads; LARS's pass 2 all three. Without masters, where pass 1 sees every dtype of the step,
    it refuses exactly what the backend refuses."""
    from fusedopt.backends.cuda import CudaBackend

    accepts = CudaBackend.unavailable_reason  # a function of its arguments alone
    dev = torch.device("cuda")
    t = {d: [torch.zeros(4, dtype=d)] for d in DTYPE_CODE}
    step = [torch.zeros((), dtype=torch.float32)]
    seen = 0
    for p in DTYPE_CODE:
        for g in DTYPE_CODE:
            ok = accepts(None, dev, p, g) is None
            for masters in (False, True) if p in (torch.bfloat16, torch.float16) else (False,):
                w = t[torch.float32] if masters else t[p]
                params = t[p] if masters else None
                passes = {
                    "pass1": Lists(w, t[g], w, w, None, step, g),
                    "lamb_pass2": Lists(w, None, w, w, params, step),
                    "lars_pass2": Lists(w, t[g], w, None, params, step, g),
                }
                verdicts = {name: _binding_refuses(emu, b) for name, b in passes.items()}
                label = f"params {p}, grads {g}, masters {masters}"
                if ok:
                    seen += 1
                    assert verdicts == dict.fromkeys(passes), (label, verdicts)
                elif not masters:
                    assert verdicts["pass1"] is not None, label
    assert seen == len(DTYPE_CONFIGS)


# ============================================================================== determinism

@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_scheduling_order_does_not_change_a_bit(fresh, kind):
    """Params, states and sums are bit-identical whatever order the fibers of a block resume in
    and the blocks run in (a race between threads or blocks would show: see
    test_resume_order_exposes_a_shared_memory_race and
    test_warp_skew_exposes_missing_barriers)."""
    shapes = [(2 * CHUNK + 1,), (CHUNK + 1,), (0,)] + [(1 + i % 9,) for i in range(70)]
    hyper = {"lamb": dict(trust_ratio_bounds=(0.5, 2.0)), "lars": dict(weight_decay=1e-4)}[kind]
    results = []
    for threads, blocks, seed in ((FORWARD, FORWARD, 0), (REVERSE, REVERSE, 0),
                                  (RANDOM, RANDOM, 1), (RANDOM, FORWARD, 2),
                                  (WARP_SKEW, REVERSE, 0), (WARP_SKEW_RANDOM, RANDOM, 3)):
        fresh.schedule(threads, blocks, seed)
        run = run_case(fresh, Case(kind, shapes, hyper, steps=2, grad_mult=0.5))
        norms = fresh.sq_norms([p for p in run.params])
        results.append(all_outputs(run) + [norms])
    check_against_reference(run)
    for other in results[1:]:
        assert_bitwise(other, results[0], "outputs under another schedule")


# ====================================================================== the checks can fail

@pytest.mark.parametrize("kind,wrong", [
    ("lamb", dict(weight_decay=0.02)), ("lamb", dict(betas=(0.9, 0.99))),
    ("lamb", dict(bias_correction=False)),
    ("lars", dict(weight_decay=2e-4)), ("lars", dict(nesterov=True)),
    ("lars", dict(trust_coefficient=0.0011))],
    ids=["lamb_wd", "lamb_beta2", "lamb_bias_correction", "lars_wd", "lars_nesterov",
         "lars_kappa"])
def test_the_comparisons_are_not_vacuous(fresh, kind, wrong):
    """Kernels given slightly wrong hyper-parameters fail the reference checks used above."""
    hyper = {"lamb": {}, "lars": dict(weight_decay=1e-4)}[kind]
    run = run_case(fresh, Case(kind, SHAPES, hyper, kernel_hyper=wrong))
    with pytest.raises(AssertionError):
        check_against_reference(run)


@pytest.mark.build
def test_the_step_tests_catch_a_planted_bug():
    """tests/simt_mutations.py with one of its mutations (LAMB's pass 1 deciding on 16-byte
    accesses without testing v's alignment): the step tests, built from the mutated copy of
    csrc/, must fail. The script also plants missing barriers, other alignment tests and slips
    of the 8-bit maps, and runs a control; each mutation takes a build and a pytest run, so only
    this one runs here (docs/cuda_emulation.md)."""
    import simt_mutations

    out = simt_mutations.check(["alignment_check"], control=False, first_failure=True,
                               log=lambda *_: None)["alignment_check"]
    assert simt_mutations.caught(out), simt_mutations.summary("alignment_check", out)


def test_the_guards_and_bitwise_checks_can_fail():
    arena = Arena()
    arena.place(torch.zeros(5), misalign=True)
    arena.check_guards()
    buf, lead, n = arena.buffers[0]
    buf[lead + n] = 0.0  # one element past the end
    with pytest.raises(AssertionError, match="outside a tensor"):
        arena.check_guards()
    a = torch.tensor([1.0, 2.0])
    b = a.clone()
    b.view(torch.int32)[1] += 1  # one ulp
    with pytest.raises(AssertionError, match="differ bitwise"):
        assert_bitwise([a], [b])


def test_nan_norms_give_nan_trust_ratios(fresh):
    """Note [NaN propagation] of math.h, with the inputs the other backends' tests use
    (helpers.nan_rule_runs): a NaN norm gives a NaN ratio, which the bounds keep."""
    runs = {}
    for case in NAN_RULE_CASES:
        kind, w, g, hyper = nan_rule_inputs(case)
        arena = Arena()
        weights = [arena.place(x, False) for x in w]
        grads = [arena.place(x, False) for x in g]
        state1 = [arena.place(torch.zeros_like(x), False) for x in w]
        state2 = [arena.place(torch.zeros_like(x), False) for x in w] if kind == "lamb" else None
        steps = [arena.place(torch.zeros(()), False) for _ in w]
        make = lamb_hyper if kind == "lamb" else lars_hyper
        h = make(hyper, LR[kind])
        scalars = DeviceScalarsC(None, None, None)
        sums = fresh.run_pass(f"{kind}_pass1", Lists(weights, grads, state1, state2, None, steps,
                                                     torch.float32), h, scalars)
        b2 = (Lists(weights, None, state1, state2, None, steps) if kind == "lamb"
              else Lists(weights, grads, state1, None, None, steps, torch.float32))
        fresh.run_pass(f"{kind}_pass2", b2, h, scalars, sums)
        arena.check_guards()
        ref = (ReferenceLAMB if kind == "lamb" else ReferenceLARS)([{**hyper, "lr": LR[kind]}])
        ref_w = [w[1].double()]
        ref.step([ref_w], [[g[1].double()]])
        runs[case] = (weights, ref_w[0])
    assert_nan_rule(runs)
