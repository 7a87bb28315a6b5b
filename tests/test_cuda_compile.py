"""Compile-only checks of the CUDA backend: they need nvcc, not a GPU or a CUDA build of torch.

Every ``csrc/**/*.cu`` is compiled with ``nvcc -c`` for sm_80 and sm_90 with ``-Xptxas -v`` (the
flags of setup.py plus torch's own nvcc defines), and must build without warnings from our sources
and with no register spills in any function. The torch binding ``csrc/cuda/bindings.cpp`` is checked
with the host compiler (``-fsyntax-only``), which also checks at compile time that its operator
signatures are those of the CPU kernels (and so of the shared schemas).

The per-element math of the CUDA kernels is ``csrc/fusedopt/math.h``, the same header the C++ CPU
backend compiles; its numerics are tested on the host by the CPU backend's tests against the
float64 reference, and on a GPU by tests/test_cuda_gpu.py. Every run compiles into a fresh temporary
directory, two compilers at a time; the log of a command that succeeded is kept in pytest's cache
(tests/build_cache.py), keyed by the command, nvcc's and the host compiler's versions, every file
under csrc/ and the installed torch (its headers), and reused while none of them changes.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch.utils.cpp_extension as cpp_extension

from build_cache import Cache, Hasher

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
NVCC = shutil.which("nvcc")
CXX = shutil.which("c++") or shutil.which("g++")
ARCHS = ("80", "90")
CU_SOURCES = sorted(CSRC.rglob("*.cu"))
BINDING = CSRC / "cuda" / "bindings.cpp"
TORCH_INCLUDE = [Path(p) for p in cpp_extension.include_paths()]
# setup.py's nvcc flags, and the defines torch's CUDAExtension adds to every nvcc command
NVCC_FLAGS = ["-O3", "-std=c++20", *getattr(cpp_extension, "COMMON_NVCC_FLAGS", [])]
TIMEOUT_S = 300

pytestmark = [pytest.mark.build,
              pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH: the CUDA sources "
                                 "cannot be compiled on this machine")]

_ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(sm_\d+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")


def _cuda_include() -> Path | None:
    """The toolkit's include directory, as nvcc itself reports it."""
    out = subprocess.run([NVCC, "-dryrun", "-c", "-x", "cu", "/dev/null", "-o", "/dev/null"],
                         capture_output=True, text=True).stderr
    for line in out.splitlines():
        if "INCLUDES=" in line:
            m = re.search(r'-I"?([^"\s]+)', line)
            if m and (Path(m.group(1)) / "cuda_runtime_api.h").exists():
                return Path(m.group(1)).resolve()
    for base in ("/usr/local/cuda",):
        if (Path(base) / "include" / "cuda_runtime_api.h").exists():
            return Path(base) / "include"
    return None


def _run(cmd: list[str]) -> tuple[int, str]:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    return p.returncode, p.stdout + p.stderr


def _our_warnings(output: str) -> list[str]:
    """Warning lines not located in torch's headers (so: ours, nvcc's or ptxas's)."""
    torch_dirs = tuple(str(p) for p in TORCH_INCLUDE)
    return [line for line in output.splitlines()
            if re.search(r"\bwarning\b", line, re.IGNORECASE) and not line.startswith(torch_dirs)]


def _parse_ptxas(output: str) -> list[dict]:
    """One record per (function, arch): registers (entry functions), stack frame, spills."""
    records, current, arch, pending = [], None, None, None
    for line in output.splitlines():
        if m := _ENTRY.search(line):
            arch = m.group(2)
            current = {"name": m.group(1), "arch": arch, "entry": True}
            records.append(current)
        elif m := _PROPS.search(line):
            pending = m.group(1)
        elif (m := _FRAME.search(line)) and pending is not None:
            rec = current if current is not None and current["name"] == pending else None
            if rec is None:  # a non-inlined device function called by the current entry
                rec = {"name": pending, "arch": arch, "entry": False}
                records.append(rec)
            rec.update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                       spill_loads=int(m.group(3)))
            pending = None
        elif (m := _USED.search(line)) and current is not None:
            current["registers"] = int(m.group(1))
    return records


def _demangle(names: list[str]) -> dict[str, str]:
    cxxfilt = shutil.which("c++filt")
    if cxxfilt is None or not names:
        return {n: n for n in names}
    out = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True).stdout
    return dict(zip(names, out.splitlines()))


# generated by torch's CMake build and absent from the CPU wheel
CMAKE_MACROS = "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n"


def _toolchain_key() -> Hasher:
    """What every command's output depends on besides the command itself."""
    return (Hasher("cuda_compile").tool("nvcc", NVCC).tool("cxx", CXX)
            .tool("gcc", shutil.which("gcc")).tool("g++", shutil.which("g++"))  # nvcc's host
            .tree("csrc", CSRC).add("cmake macros", CMAKE_MACROS).dist("torch").environment())


def _compile_cached(cache: Cache, base: Hasher, tmp: Path, cmd: list[str]) -> tuple[int, str]:
    """``_run(cmd)``, or the log of the same command with the same inputs that succeeded before."""
    key = base.copy().add("cmd", [c.replace(str(tmp), "<tmp>") for c in cmd]).hexdigest()
    if (entry := cache.lookup(key)) is not None:
        return 0, (entry / "log.txt").read_text()
    rc, out = _run(cmd)
    if rc == 0 and _toolchain_key().hexdigest() == base.hexdigest():  # csrc unchanged meanwhile
        cache.store(key, lambda d: (d / "log.txt").write_text(out))
    return rc, out


@pytest.fixture(scope="module")
def builds(request, tmp_path_factory):
    """Compile every .cu file and syntax-check the binding, two at a time, in a fresh directory
    (or reuse the logs of the same commands on the same inputs)."""
    tmp = tmp_path_factory.mktemp("cuda_compile")
    shim = tmp / "include"
    (shim / "c10" / "cuda" / "impl").mkdir(parents=True)
    (shim / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").write_text(CMAKE_MACROS)
    includes = ["-I", str(CSRC), "-I", str(shim)]
    for p in TORCH_INCLUDE:
        includes += ["-isystem", str(p)]
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS]
    jobs = {}
    for src in CU_SOURCES:
        obj = tmp / (src.stem + ".o")
        jobs[src.relative_to(ROOT).as_posix()] = [
            NVCC, "-c", str(src), "-o", str(obj), *NVCC_FLAGS, *gencode, "-Xptxas", "-v",
            "-Xcompiler", "-Wall,-Wextra,-fPIC", *includes]
    cuda_include = _cuda_include()
    if CXX is not None and BINDING.exists() and cuda_include is not None:
        host = ["-isystem", str(cuda_include), "-isystem", sysconfig.get_paths()["include"]]
        jobs[BINDING.relative_to(ROOT).as_posix()] = [
            CXX, "-std=c++20", "-fsyntax-only", "-Wall", "-Wextra", str(BINDING), *includes, *host]
    cache = Cache(request.config, "cuda_compile", keep=4 * len(jobs))
    base = _toolchain_key()
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_compile_cached, cache, base, tmp, cmd)
                   for name, cmd in jobs.items()}
        results = {name: f.result() for name, f in futures.items()}
    records = [dict(r, source=name) for name, (_, out) in results.items()
               for r in _parse_ptxas(out)]
    _print_summary(records)
    return results, records


def _print_summary(records: list[dict]) -> None:
    names = _demangle(sorted({r["name"] for r in records}))
    print("\nptxas summary (registers / stack frame / spill stores / spill loads):")
    seen = set()
    for r in sorted(records, key=lambda r: (r["source"], names[r["name"]], r["arch"])):
        key = (r["source"], r["name"], r["arch"])
        if key in seen:  # a device function reported once per kernel that calls it
            continue
        seen.add(key)
        short = re.sub(r"\(anonymous namespace\)::|fusedopt::cuda::", "", names[r["name"]])
        print(f"  {r['arch']}  regs {r.get('registers', '-'):>3}  stack {r.get('stack', '-')}  "
              f"spill {r.get('spill_stores', '-')}/{r.get('spill_loads', '-')}  "
              f"{r['source'].rsplit('/', 1)[-1]}  {short}")


@pytest.mark.parametrize("source", [p.relative_to(ROOT).as_posix() for p in CU_SOURCES])
def test_cu_file_compiles_without_warnings(builds, source):
    rc, out = builds[0][source]
    assert rc == 0, f"nvcc failed on {source}:\n{out[-6000:]}"
    warnings = _our_warnings(out)
    assert not warnings, f"warnings compiling {source}:\n" + "\n".join(warnings[:40])


@pytest.mark.parametrize("source", [p.relative_to(ROOT).as_posix() for p in CU_SOURCES])
def test_kernels_built_for_every_arch_without_spills(builds, source):
    records = [r for r in builds[1] if r["source"] == source]
    entries = [r for r in records if r["entry"]]
    assert entries, f"ptxas reported no kernel for {source}"
    assert {r["arch"] for r in entries} == {f"sm_{a}" for a in ARCHS}
    # every kernel exists for both architectures
    by_arch = {a: sorted(r["name"] for r in entries if r["arch"] == f"sm_{a}") for a in ARCHS}
    assert by_arch[ARCHS[0]] == by_arch[ARCHS[1]]
    spilling = [r for r in records if r.get("spill_stores") != 0 or r.get("spill_loads") != 0]
    assert not spilling, "register spills (or no ptxas report):\n" + "\n".join(
        f"{r['arch']} {r['name']}: {r.get('spill_stores')} B stores, {r.get('spill_loads')} B loads"
        for r in spilling)
    # Kernel tables are read in place from the argument space (__grid_constant__), never copied
    # to local memory: no kernel has a stack frame.
    framed = [r for r in entries if r.get("stack") != 0]
    assert not framed, "kernels with a stack frame:\n" + "\n".join(
        f"{r['arch']} {r['name']}: {r.get('stack')} B" for r in framed)


def test_binding_compiles_with_the_host_compiler(builds):
    name = BINDING.relative_to(ROOT).as_posix()
    if not BINDING.exists():
        pytest.fail(f"{name} is missing")
    if name not in builds[0]:
        pytest.skip("no host C++ compiler or CUDA include directory found for the binding check")
    rc, out = builds[0][name]
    assert rc == 0, f"the binding does not compile:\n{out[-6000:]}"
    warnings = _our_warnings(out)
    assert not warnings, "warnings compiling the binding:\n" + "\n".join(warnings[:40])


def test_every_source_kind_is_covered():
    """The CUDA extension's sources (setup.py: csrc/cuda/*.cu + *.cpp) are all checked here."""
    assert CU_SOURCES, "no .cu source under csrc/"
    cpp = sorted((CSRC / "cuda").glob("*.cpp"))
    assert cpp == [BINDING], f"unchecked C++ sources in csrc/cuda: {cpp}"
