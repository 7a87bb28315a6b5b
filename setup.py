"""Build fusedopt: the C++ CPU extension always, the CUDA extension when it can link.

The CUDA extension is built when torch is a CUDA build and nvcc is found, or when
FUSEDOPT_BUILD_CUDA=1 forces it (FUSEDOPT_BUILD_CUDA=0 turns it off); TORCH_CUDA_ARCH_LIST is
honoured. A failed extension build never fails the install: the error is stored in
fusedopt/_build_errors.txt, backend="auto" falls back to eager, and an explicit backend raises it.
"""
import glob
import os
import shutil
import subprocess

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

HERE = os.path.dirname(os.path.abspath(__file__))
ERRORS = os.path.join(HERE, "fusedopt", "_build_errors.txt")
# -fno-math-errno: GCC vectorizes sqrt only without errno (LAMB ran 4-6x slower without it).
# -fno-trapping-math: a loop of selects between float operations is if-converted (vectorized)
# without AVX-512's masks too; every operation still rounds as IEEE 754 says (the default rounding
# mode is assumed either way).
# -ffp-contract=off: no FMA contraction, so the ISA clones of the CPU kernels agree bit for bit
# (Note [ISA clones] in csrc/cpu/multi_tensor.h). C++20 as torch 2.13 builds its extensions.
# -g0 overrides the -g of Python's build flags: the debug info of the kernels' many template
# instances is most of the object and of its compile time, and never changes the code
# (docs/performance.md, "Building").
CXX_FLAGS = ["-O3", "-g0", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off",
             "-fopenmp", "-fvisibility=hidden", "-std=c++20"]
# GCC's generic tuning loads a vectorized table lookup lane by lane (it avoids the gather
# instructions for the CPUs where microcode made them slow); the LARS 8-bit map looks up three
# tables per element, one gather per vector each with the switch (its price against the lane by
# lane loads: docs/performance.md, "Low-precision state"). Clang has no such switch and gathers
# by its own cost model.
GCC_FLAGS = ["-mtune-ctrl=use_gather"]


def is_gcc(cmd: str) -> bool:
    try:
        out = subprocess.run([cmd, "--version"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return False
    return "Free Software Foundation" in out and "clang" not in out


def want_cuda() -> bool:
    forced = os.environ.get("FUSEDOPT_BUILD_CUDA")
    if forced is not None:
        return forced == "1"
    return torch.version.cuda is not None and (CUDA_HOME is not None or shutil.which("nvcc") is not None)


class TolerantBuild(BuildExtension):
    """Build each extension; record a failure instead of aborting the install."""

    def run(self):
        if os.path.exists(ERRORS):
            os.remove(ERRORS)
        super().run()

    def build_extensions(self):
        # torch checks the host compiler and the CUDA toolkit here, before it builds any
        # extension: a toolkit that does not match torch's CUDA must cost the CUDA extension
        # only, and a compiler torch refuses costs the extensions, never the install
        try:
            super().build_extensions()
        except Exception as e:  # noqa: BLE001 - torch's checks raise several types
            cuda = [x for x in self.extensions if any(s.endswith(".cu") for s in x.sources)]
            self._failed(cuda or self.extensions, e)
            if not cuda or len(cuda) == len(self.extensions):
                return
            self.extensions = [x for x in self.extensions if x not in cuda]
            try:
                super().build_extensions()
            except Exception as e2:  # noqa: BLE001
                self._failed(self.extensions, e2)

    def build_extension(self, ext):
        if isinstance(ext.extra_compile_args, list) and is_gcc(self.compiler.compiler_so[0]):
            ext.extra_compile_args = ext.extra_compile_args + GCC_FLAGS
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001 - any compiler/linker failure
            self._failed([ext], e)

    @staticmethod
    def _failed(exts, e):
        for ext in exts:
            with open(ERRORS, "a") as f:
                f.write(f"{ext.name}: {type(e).__name__}: {e}\n")
            print(f"fusedopt: building {ext.name} failed ({e}); that backend will be unavailable")


ext_modules = []
cpu_sources = sorted(glob.glob("csrc/cpu/*.cpp"))
if cpu_sources:
    ext_modules.append(CppExtension(
        "fusedopt._C", cpu_sources, include_dirs=[os.path.join(HERE, "csrc")],
        extra_compile_args=CXX_FLAGS, extra_link_args=["-fopenmp"],
    ))
cuda_sources = sorted(glob.glob("csrc/cuda/*.cu") + glob.glob("csrc/cuda/*.cpp"))
if cuda_sources and want_cuda():
    ext_modules.append(CUDAExtension(
        "fusedopt._cuda", cuda_sources, include_dirs=[os.path.join(HERE, "csrc")],
        extra_compile_args={"cxx": ["-O3", "-g0", "-std=c++20"], "nvcc": ["-O3", "-std=c++20"]},
    ))
print("fusedopt: building " + (", ".join(e.name for e in ext_modules) or "no compiled extension"))

setup(ext_modules=ext_modules, cmdclass={"build_ext": TolerantBuild})
