"""Backend selection: what auto picks, and that the compiled/optional backends are really present
where this project's set-up installs them (so their tests cannot silently skip)."""
import importlib.util
import os

import pytest
import torch

import fusedopt
from fusedopt import backends


def test_auto_picks_cpp_on_cpu():
    if backends.get_backend("cpp") is None:
        pytest.skip(f"the C++ extension is not built: {backends.load_error('cpp')}")
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for grad_dtype in (dtype, torch.bfloat16):
            be = backends.resolve("auto", torch.device("cpu"), dtype, grad_dtype)
            assert be.name == "cpp", (dtype, grad_dtype)
    cpp = backends.get_backend("cpp")
    assert "CPU tensors only" in cpp.unavailable_reason(torch.device("cuda"), torch.float32,
                                                       torch.float32)
    assert "int8" in cpp.unavailable_reason(torch.device("cpu"), torch.float32, torch.int8)


def test_auto_on_cpu_falls_back_to_eager_without_the_cpp_extension(monkeypatch):
    monkeypatch.delitem(backends._instances, "cpp", raising=False)
    monkeypatch.setitem(backends._load_errors, "cpp", "ImportError: simulated missing extension")
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        assert backends.resolve("auto", torch.device("cpu"), dtype, dtype).name == "eager"
    assert "cpp" not in fusedopt.available_backends()


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
