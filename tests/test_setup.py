"""setup.py never aborts the install over an extension: torch's own checks (host compiler, CUDA
toolkit against torch's CUDA), which run before any extension is built, cost the CUDA extension
only, and each failure is recorded for the backends to name."""
import runpy
from pathlib import Path

import pytest
import setuptools
from setuptools import Extension
from torch.utils.cpp_extension import BuildExtension

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def tolerant(monkeypatch, tmp_path):
    """setup.py's TolerantBuild (setup() not run) writing its error file under tmp_path."""
    monkeypatch.setattr(setuptools, "setup", lambda **kw: None)
    monkeypatch.chdir(ROOT)
    ns = runpy.run_path(str(ROOT / "setup.py"), run_name="fusedopt_setup_under_test")
    cls = ns["TolerantBuild"]
    errors = tmp_path / "errors.txt"
    monkeypatch.setitem(cls.build_extensions.__globals__, "ERRORS", str(errors))
    return cls, errors


def _build(cls, extensions):
    b = cls.__new__(cls)  # the distutils command machinery is not needed for build_extensions
    b.extensions = list(extensions)
    return b


def test_a_cuda_toolkit_mismatch_costs_the_cuda_extension_only(tolerant, monkeypatch):
    cls, errors = tolerant
    cpu = Extension("fusedopt._C", ["csrc/cpu/ops.cpp"])
    cuda = Extension("fusedopt._cuda", ["csrc/cuda/lamb.cu"])
    built = []

    def torch_build_extensions(self):
        if any(s.endswith(".cu") for x in self.extensions for s in x.sources):
            raise RuntimeError("The detected CUDA version (13.0) mismatches the version that was "
                               "used to compile PyTorch (12.8)")
        built.extend(x.name for x in self.extensions)

    monkeypatch.setattr(BuildExtension, "build_extensions", torch_build_extensions)
    _build(cls, [cpu, cuda]).build_extensions()
    assert built == ["fusedopt._C"]
    text = errors.read_text()
    assert "fusedopt._cuda: RuntimeError: The detected CUDA version" in text
    assert "fusedopt._C" not in text


def test_a_refused_compiler_is_recorded_not_raised(tolerant, monkeypatch):
    cls, errors = tolerant

    def refuse(self):
        raise OSError("g++ 4.8 is not supported")

    monkeypatch.setattr(BuildExtension, "build_extensions", refuse)
    _build(cls, [Extension("fusedopt._C", ["csrc/cpu/ops.cpp"])]).build_extensions()
    assert errors.read_text().startswith("fusedopt._C: OSError: g++ 4.8")


def test_the_cpu_extension_is_built_in_this_tree():
    """The install records a failed build instead of failing (tests above), so a C++ change that
    no longer compiles would otherwise show only as skipped cpp tests: the test command builds the
    extension, and here it must have succeeded, with the native scans bound to it."""
    from fusedopt import _bucket
    from fusedopt.backends import cpp

    try:
        from fusedopt import _C
    except ImportError as e:
        errors = Path(cpp._BUILD_ERRORS)
        pytest.fail(f"fusedopt._C is not importable: {e}; build errors recorded at install: "
                    f"{errors.read_text() if errors.exists() else 'none'}")
    for name in ("data_ptrs", "dense", "dtype_codes", "grads", "numels"):
        assert getattr(_bucket, name) is getattr(_C, name), name


@pytest.mark.parametrize("version, gathers", [
    ("g++ (Debian 12.2.0-14) 12.2.0\nCopyright (C) 2022 Free Software Foundation, Inc.", True),
    ("Debian clang version 14.0.6\nTarget: x86_64-pc-linux-gnu", False),
])
def test_the_cpu_extension_asks_gcc_for_gather_instructions(tolerant, monkeypatch, tmp_path,
                                                            version, gathers):
    """GCC's generic tuning loads a vectorized table lookup lane by lane; the CPU extension asks
    it for the gather instructions (setup.py, GCC_FLAGS), a compiler that is not GCC is asked
    nothing it does not know."""
    cls, _ = tolerant
    compiler = tmp_path / "c++"
    compiler.write_text(f"#!/bin/sh\ncat <<'END'\n{version}\nEND\n")
    compiler.chmod(0o755)
    seen = []
    monkeypatch.setattr(BuildExtension, "build_extension",
                        lambda self, ext: seen.append(list(ext.extra_compile_args)))
    b = _build(cls, [])
    b.compiler = type("Compiler", (), {"compiler_so": [str(compiler), "-O3"]})()
    b.build_extension(Extension("fusedopt._C", ["csrc/cpu/ops.cpp"], extra_compile_args=["-O3"]))
    assert seen == [["-O3", "-mtune-ctrl=use_gather"] if gathers else ["-O3"]]
