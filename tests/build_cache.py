"""A cache of the build-verification tests' outputs (tests/test_triton_compile.py,
tests/test_cuda_compile.py, tests/test_cuda_emulated.py), kept in pytest's cache directory
(``.pytest_cache/d/fusedopt-builds/<kind>/<key>``; ``pytest --cache-clear`` empties it).

An entry is keyed by a hash of every input of the build: the source files (all of them, not only
those a build is known to read), the compiler's identity and version, the flags, the versions and
installed files of torch / triton, and the environment variables the compilers read. Only a build
that succeeded is stored, so a build that fails runs (and fails) again on every run: the cache can
make a test faster, never greener. An entry is written to a staging directory and renamed into
place, so concurrent runs never see half of one; the ``KEEP`` most recently used entries of each
kind are kept.

:func:`run` is how those tests, and the steps of scripts/gpu_verify.py, start their commands: in a
process group that a timeout ends.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEEP = 4
# read by gcc / nvcc / Triton / LLVM: they can change what a build produces
ENV_PREFIXES = ("TRITON_", "MLIR_", "LLVM_", "NVCC_", "CUDA_", "FUSEDOPT_", "CPATH", "C_INCLUDE_PATH",
                "CPLUS_INCLUDE_PATH", "LIBRARY_PATH", "GCC_", "COMPILER_PATH")


def run(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)`` with the
    command in a session of its own, so that a timeout or an interrupted run (any exception while
    waiting) kills its whole process group: a compiler driver killed alone leaves its children
    (cc1plus, cicc, ptxas, a pool of Triton compilers) running as orphans beside the tests that
    follow. Raises ``subprocess.TimeoutExpired`` (with the output so far) after a timeout."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException as e:
        with contextlib.suppress(ProcessLookupError):  # every process of the group gone already
            os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        if isinstance(e, subprocess.TimeoutExpired):
            raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr) from None
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


class Hasher:
    """sha256 over labelled parts."""

    def __init__(self, kind: str):
        self._h = hashlib.sha256(f"fusedopt-build-cache 1 {kind}\n".encode())

    def add(self, label: str, value) -> "Hasher":
        data = value if isinstance(value, bytes) else repr(value).encode()
        self._h.update(f"{label} {len(data)}\n".encode())
        self._h.update(data)
        return self

    def files(self, label: str, paths) -> "Hasher":
        for p in sorted(set(map(Path, paths))):
            self.add(f"{label} {p}", p.read_bytes() if p.is_file() else b"<missing>")
        return self

    def tree(self, label: str, *dirs: Path) -> "Hasher":
        """Every file under ``dirs`` (compiled caches and objects excluded), path and content."""
        return self.files(label, [p for d in dirs for p in d.rglob("*") if p.is_file()
                                  and "__pycache__" not in p.parts
                                  and p.suffix not in (".pyc", ".so", ".o", ".d")])

    def tool(self, label: str, exe: str | None) -> "Hasher":
        """A compiler's resolved path and its ``--version``."""
        if exe is None:
            return self.add(label, None)
        real = os.path.realpath(exe)
        p = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
        return self.add(label, (exe, real, p.returncode, p.stdout, p.stderr))

    def dist(self, name: str) -> "Hasher":
        """An installed distribution: its version and RECORD (a hash of each installed file)."""
        try:
            d = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            return self.add(f"dist {name}", None)
        return self.add(f"dist {name}", (d.version, d.read_text("RECORD")))

    def environment(self) -> "Hasher":
        env = sorted((k, v) for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)
                     and k not in ("TRITON_INTERPRET", "TRITON_CACHE_DIR"))
        return self.add("env", (env, sys.version, sys.executable))

    def copy(self) -> "Hasher":
        h = Hasher.__new__(Hasher)
        h._h = self._h.copy()
        return h

    def hexdigest(self) -> str:
        return self._h.hexdigest()[:32]


def root(config) -> Path | None:
    """The cache's directory, or None where pytest's cache is off (``-p no:cacheprovider``)."""
    cache = getattr(config, "cache", None)
    return None if cache is None else Path(cache.mkdir("fusedopt-builds"))


class Cache:
    """The entries of one kind of build: ``lookup`` a key, or ``store`` a finished build."""

    def __init__(self, config, kind: str, keep: int = KEEP):
        base = root(config)
        self.dir = None if base is None else base / kind
        self.keep = keep

    def lookup(self, key: str) -> Path | None:
        if self.dir is None:
            return None
        entry = self.dir / key
        if not entry.is_dir():
            return None
        try:
            os.utime(entry)  # recently used: pruned last
        except OSError:
            return None
        return entry

    def store(self, key: str, fill) -> Path | None:
        """``fill(dir)`` writes a successful build's outputs into a staging directory, which then
        becomes the entry for ``key`` (unless another run stored it first)."""
        if self.dir is None:
            return None
        self.dir.mkdir(parents=True, exist_ok=True)
        stage = self.dir / f".stage-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        stage.mkdir()
        try:
            fill(stage)
            os.rename(stage, self.dir / key)
        except OSError:  # stored by a concurrent run, or the disk is full: the build still stands
            shutil.rmtree(stage, ignore_errors=True)
        self._prune()
        return self.lookup(key)

    def _prune(self) -> None:
        now = time.time()
        entries = []
        for p in self.dir.iterdir():
            try:
                mtime = p.stat().st_mtime
            except OSError:
                continue
            if p.name.startswith(".stage-"):
                if now - mtime > 3600:  # left by a run that was killed
                    shutil.rmtree(p, ignore_errors=True)
            else:
                entries.append((mtime, p))
        for _, p in sorted(entries, reverse=True)[self.keep:]:
            shutil.rmtree(p, ignore_errors=True)
