"""Backend selection: what auto picks, and that the compiled/optional backends are really present
where this project's set-up installs them (so their tests cannot silently skip)."""
import importlib.util
import os

import pytest
import torch

import fusedopt
from fusedopt import backends


def test_auto_on_cpu_prefers_cpp_then_eager():
    be = backends.resolve("auto", torch.device("cpu"), torch.float32, torch.float32)
    expected = "cpp" if "cpp" in fusedopt.available_backends() else "eager"
    assert be.name == expected


@pytest.mark.skipif(os.environ.get("FUSEDOPT_ALLOW_NO_CPP") == "1",
                    reason="FUSEDOPT_ALLOW_NO_CPP=1: this environment builds without the C++ extension")
def test_cpp_extension_is_built():
    assert "cpp" in fusedopt.available_backends(), backends.load_error("cpp")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_backend_imports_when_triton_is_installed():
    assert backends.get_backend("triton") is not None, backends.load_error("triton")


def test_explicit_backend_error_names_device_dtype_and_reason(monkeypatch):
    be = backends.get_backend("triton")
    if be is None:
        pytest.skip(f"triton backend not importable: {backends.load_error('triton')}")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # read when a backend is chosen
    with pytest.raises(RuntimeError, match=r"backend='triton' cannot run on cpu tensors with param dtype torch.float32"):
        backends.resolve("triton", torch.device("cpu"), torch.float32, torch.float32)


def test_unknown_backend_module_failure_is_reported():
    with pytest.raises(RuntimeError, match=r"backend='cuda' is not available in this process"):
        backends.resolve("cuda", torch.device("cpu"), torch.float32, torch.float32)
