"""tests/build_cache.py's ``run``: a build that runs past its limit is stopped with every process
it started, not only the one the test launched."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from build_cache import run

# a driver that starts a compiler-like child, says its pid, and waits for it (as gcc, nvcc and
# the Triton compile helper do)
DRIVER = ("import subprocess, sys, time\n"
          "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
          "print(child.pid, flush=True)\n"
          "child.wait()\n")


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")
def test_a_timeout_stops_the_children_too():
    with pytest.raises(subprocess.TimeoutExpired) as e:
        run([sys.executable, "-c", DRIVER], timeout=10)
    assert e.value.stdout, f"the driver started no child within the limit: {e.value.stderr}"
    child = int(e.value.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), f"the driver's child {child} outlived the timeout"


def test_a_finished_command_returns_its_output_and_status():
    p = run([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); "
             "sys.exit(3)"], timeout=60)
    assert (p.returncode, p.stdout, p.stderr) == (3, "out\n", "err\n")
