#!/usr/bin/env python3
"""Set up a virtual environment in .venv and run one of the project's jobs. Needs only python3.

    python3 scripts/dev.py demo [args]    # the large-batch training demo (the main job)
    python3 scripts/dev.py test [args]    # the test suite (what CI runs), the slowest 25 listed
    python3 scripts/dev.py bench [args]   # the step-time benchmark table

torch is installed first, from FUSEDOPT_TORCH (default ``torch==2.13.0``: a CPU build on our
machines; an unpinned torch would pull a multi-GB CUDA build), then requirements-dev.txt, timm,
bitsandbytes and torchao (without their dependencies), then the project itself with
``pip install --no-build-isolation -e .`` (this builds the C++ extension).
Set-up steps are skipped when their inputs have not changed since the last run.
"""
import hashlib
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv"
PY = VENV / "bin" / "python"
TORCH = os.environ.get("FUSEDOPT_TORCH", "torch==2.13.0")
TIMM = "timm==1.0.31"
# the peers' 8-bit optimizers, which tests/test_low_precision_peers.py and bench/low_precision.py
# compare with; without their dependencies (bitsandbytes' would pull another torch)
PEERS = ("bitsandbytes==0.50.2", "torchao==0.18.0")


def sh(*cmd: str, **kw) -> None:
    print("+", " ".join(cmd), flush=True)
    # DS_BUILD_OPS=0: deepspeed (requirements-dev.txt) compiles none of its ops at install
    subprocess.run(cmd, check=True, cwd=ROOT, env=dict(os.environ, DS_BUILD_OPS="0"), **kw)


def digest(paths) -> str:
    h = hashlib.sha256(TORCH.encode())
    for p in sorted(paths):
        h.update(str(p.relative_to(ROOT)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def step_once(name: str, inputs, *cmd: str) -> None:
    stamp = VENV / f".stamp-{name}"
    key = digest(inputs)
    if stamp.exists() and stamp.read_text() == key:
        return
    sh(*cmd)
    stamp.write_text(key)


def setup() -> None:
    if not PY.exists():
        sh(sys.executable, "-m", "venv", str(VENV))
    # --no-compile: pip compiles the installed files one at a time; they are compiled below, on
    # every core, once (the test workers, ranks and CLI processes would otherwise each compile the
    # modules they import before a .pyc exists)
    pip = (str(PY), "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-compile")
    step_once("torch", [], *pip, *shlex.split(TORCH))
    step_once("deps", [ROOT / "requirements-dev.txt"], *pip, "-r", "requirements-dev.txt")
    # timm's optimizers are a comparison in the tests and the benchmark. Without its dependencies:
    # they pull torchvision, which needs (and would install) a torch other than ours.
    step_once(TIMM, [], *pip, "--no-deps", TIMM)  # the pin names the stamp
    step_once("-".join(PEERS), [], *pip, "--no-deps", *PEERS)
    # compile_dir goes on past a file that does not compile (some packages ship templates named
    # .py), as pip's own compile step does
    step_once("bytecode", [ROOT / "requirements-dev.txt"], str(PY), "-c",
              "import compileall, sysconfig; compileall.compile_dir("
              "sysconfig.get_paths()['purelib'], quiet=2, workers=0)")
    sources = [ROOT / "setup.py", ROOT / "pyproject.toml", *ROOT.glob("csrc/**/*.*")]
    step_once("project", sources, *pip, "--no-build-isolation", "-e", ".")


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ("demo", "test", "bench"):
        print(__doc__)
        return 2
    job, args = sys.argv[1], sys.argv[2:]
    setup()
    if job == "demo":
        cmd = [str(PY), "-m", "fusedopt", "demo", *args]
    elif job == "bench":
        cmd = [str(PY), "-m", "fusedopt.tools.bench", *args]
    else:
        # the 25 slowest tests are listed (setup, where the builds happen, counted apart)
        cmd = [str(PY), "-m", "pytest", "-n", "2", "--dist", "loadfile", "-q", "--durations=25",
               *args]
    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
