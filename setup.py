"""isoloco_kernels: pure Python (+ Triton) by default, with an optional CUDA extension `_C`.

The extension (csrc/, built by CMakeLists.txt with ninja) is built when the build environment has a
CUDA build of torch, nvcc, and CMake >= 3.26 with ninja (e.g. the PyPI `cmake` and `ninja`):

    pip install --no-build-isolation -e .           # builds _C when it can, else says why not
    ISOLOCO_CUDA=1 pip install --no-build-isolation -e .   # must build _C, fails loudly otherwise
    ISOLOCO_CUDA=0 pip install .                    # never builds it

Plain `pip install .` uses build isolation, which hides the installed torch: it installs the pure
Python package. Other knobs: TORCH_CUDA_ARCH_LIST (default "8.0;9.0+PTX": A100 and H100/H200 cubins plus
sm_90 PTX that newer GPUs JIT-compile; the kernels need sm_80), MAX_JOBS, CUDA_HOME.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
KERNEL_SOURCES = os.path.join("csrc", "kernels")  # NVRTC-clean kernels, shipped for _cupy.py
MIN_CMAKE = (3, 26)
DEFAULT_ARCHS = "8.0;9.0+PTX"  # as in CMakeLists.txt


def _find_cuda_home() -> str | None:
    """A CUDA toolkit root (with bin/nvcc and include/): CUDA_HOME, CUDA_PATH, /usr/local/cuda, PATH."""
    cands = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:  # may be a wrapper script outside the toolkit; then only its real location helps
        cands.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for home in cands:
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")) and os.path.isdir(os.path.join(home, "include")):
            return home
    return None


def _find_tool(module: str, attr: str, name: str) -> str | None:
    """A tool from its PyPI package (cmake, ninja) if importable, else from PATH."""
    try:
        mod = __import__(module)
        path = os.path.join(getattr(mod, attr), name)
        if os.path.isfile(path):
            return path
    except (ImportError, AttributeError):
        pass
    return shutil.which(name)


def _cmake_version(cmake: str) -> tuple[int, ...]:
    out = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"(\d+)\.(\d+)", out)
    return tuple(int(g) for g in m.groups()) if m else (0, 0)


def _wheel_cuda_root() -> str | None:
    """site-packages/nvidia/cu<N>: headers and libraries of torch's CUDA dependency wheels."""
    try:
        import nvidia
    except ImportError:
        return None
    for base in list(getattr(nvidia, "__path__", [])):
        for name in sorted(os.listdir(base), reverse=True):
            cand = os.path.join(base, name)
            if re.fullmatch(r"cu\d+", name) and os.path.isdir(os.path.join(cand, "include")):
                return cand
    return None


def _toolchain() -> tuple[dict | None, str]:
    """(tools, "") when _C can be built here, else (None, why not)."""
    try:
        import torch
        import torch.utils
    except ImportError:
        return None, (
            "torch is not importable in the build environment (pip's build isolation hides the "
            "installed one; use --no-build-isolation)"
        )
    if torch.version.cuda is None:
        return None, f"torch {torch.__version__} is a CPU-only build"
    cuda_home = _find_cuda_home()
    if cuda_home is None:
        return None, "no CUDA toolkit with nvcc found (set CUDA_HOME)"
    cmake = _find_tool("cmake", "CMAKE_BIN_DIR", "cmake")
    if cmake is None or _cmake_version(cmake) < MIN_CMAKE:
        return None, f"CMake >= {'.'.join(map(str, MIN_CMAKE))} not found (pip install cmake)"
    ninja = _find_tool("ninja", "BIN_DIR", "ninja")
    if ninja is None:
        return None, "ninja not found (pip install ninja)"
    return {
        "torch_prefix": torch.utils.cmake_prefix_path,
        "nvcc": os.path.join(cuda_home, "bin", "nvcc"),
        "cuda_home": cuda_home,
        "cmake": cmake,
        "ninja": ninja,
        "wheel_cuda_root": _wheel_cuda_root(),
    }, ""


def _decide() -> tuple[dict | None, str]:
    want = os.environ.get("ISOLOCO_CUDA", "").strip()
    if want == "0":
        return None, "ISOLOCO_CUDA=0"
    tools, why = _toolchain()
    if tools is None and want == "1":
        sys.exit(f"isoloco_kernels: ISOLOCO_CUDA=1 but the CUDA extension cannot be built: {why}")
    return tools, why


TRAIN_EXTRA = ["tqdm", "matplotlib", "tokenizers>=0.15"]

# The torch range CI tests: .ci/run installs exactly this lower bound. (The H200 checks ran torch 2.11,
# installed with --no-deps; CI does not test it, so it is not declared.)
TORCH_REQUIREMENT = "torch>=2.14.1"


def cupy_wheel() -> str:
    """The CuPy wheel for the `cupy` extra: cupy-cuda<major>x of the build environment's torch
    (importable with --no-build-isolation), else cupy-cuda13x, torch's default CUDA 13 wheels.
    Extras are fixed when the package is built, so on a CUDA 12 torch with build isolation ask
    for `.[cupy-cuda12]` or `pip install cupy-cuda12x` (the CuPy path's message names the wheel)."""
    try:
        import torch
    except ImportError:
        return "cupy-cuda13x"
    major = (torch.version.cuda or "13").split(".")[0]
    return f"cupy-cuda{major}x"


TOOLS, SKIP_REASON = _decide()
FORCED = os.environ.get("ISOLOCO_CUDA", "").strip() == "1"


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class BuildCMake(build_ext):
    """Builds each CMakeExtension with CMakeLists.txt (ninja) straight to its final path."""

    def build_extensions(self) -> None:
        for ext in list(self.extensions):
            if isinstance(ext, CMakeExtension):
                if not self._build_cmake(ext):
                    self.extensions.remove(ext)  # nothing to copy or package
            else:
                self.build_extension(ext)

    def _build_cmake(self, ext: Extension) -> bool:
        t = TOOLS
        out = os.path.abspath(self.get_ext_fullpath(ext.name))
        tmp = os.path.abspath(os.path.join(self.build_temp, "cmake"))
        os.makedirs(os.path.dirname(out), exist_ok=True)
        configure = [
            t["cmake"],
            "-S",
            ROOT,
            "-B",
            tmp,
            "-G",
            "Ninja",
            f"-DCMAKE_MAKE_PROGRAM={t['ninja']}",
            f"-DCMAKE_PREFIX_PATH={t['torch_prefix']}",
            f"-DCMAKE_CUDA_COMPILER={t['nvcc']}",
            f"-DCUDA_TOOLKIT_ROOT_DIR={t['cuda_home']}",
            f"-DTORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST', DEFAULT_ARCHS)}",
            f"-DISOLOCO_OUTPUT={out}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        if t["wheel_cuda_root"]:
            configure.append(f"-DISOLOCO_EXTRA_CUDA_ROOT={t['wheel_cuda_root']}")
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        try:
            subprocess.run(configure, check=True)
            subprocess.run([t["cmake"], "--build", tmp, "-j", jobs], check=True)
        except (subprocess.CalledProcessError, OSError) as e:
            if FORCED:
                raise
            print(
                f"isoloco_kernels: CUDA extension build failed ({e}); installing without it "
                "(set ISOLOCO_CUDA=1 to make this an error)",
                file=sys.stderr,
            )
            return False
        return True


class BuildPy(build_py):
    """Says once why the extension is skipped, and ships the kernel sources for the CuPy path."""

    def run(self) -> None:
        if TOOLS is None:
            print(f"isoloco_kernels: CUDA extension skipped: {SKIP_REASON}", file=sys.stderr)
        super().run()
        if not self.editable_mode:  # an editable install reads them from the source tree
            dst = os.path.join(self.build_lib, "isoloco_kernels", KERNEL_SOURCES)
            os.makedirs(dst, exist_ok=True)
            src = os.path.join(ROOT, KERNEL_SOURCES)
            for name in sorted(os.listdir(src)):
                if name.endswith(".cuh"):
                    self.copy_file(os.path.join(src, name), os.path.join(dst, name))


setup(
    name="isoloco_kernels",
    version="0.1.0",
    description="Fast Iso-C merging and the IsoLoCo outer optimizer for DiLoCo-style training",
    long_description=open(os.path.join(ROOT, "README.md"), encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="BSD-3-Clause",
    license_files=["LICENSE"],
    author="the isoloco_kernels developers",
    keywords=["pytorch", "diloco", "model merging", "iso-c", "distributed training", "optimizer"],
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Science/Research",
        "Intended Audience :: Developers",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Environment :: GPU :: NVIDIA CUDA",
        "Typing :: Typed",
    ],
    packages=find_packages(include=["isoloco_kernels", "isoloco_kernels.*"]),
    package_data={"isoloco_kernels": ["py.typed"]},
    python_requires=">=3.10",
    install_requires=[TORCH_REQUIREMENT, "numpy"],
    extras_require={
        # the reference training loop (python -m isoloco_kernels.train): progress bars, plots, BPE
        "train": TRAIN_EXTRA,
        # the tests, the training-loop tests included
        "test": ["pytest", "pytest-benchmark", 'triton; platform_system == "Linux"', "torchft", *TRAIN_EXTRA],
        # the CuPy path (_cupy.py): the CuPy wheel of torch's CUDA major version (see cupy_wheel)
        "cupy": [cupy_wheel()],
        "cupy-cuda12": ["cupy-cuda12x"],
        "cupy-cuda13": ["cupy-cuda13x"],
        # lint and format (pyproject.toml's [tool.ruff]); pinned: formatting may change between releases
        "lint": ["ruff==0.17.6"],
        "examples": ["torchft", "torchtitan", "hivemind"],  # examples/: torchtitan's DiLoCo setup, hivemind peers
        # the documentation site (mkdocs.yml; CI builds it with --strict): pinned, since a new release of the
        # theme or of the docstring handler can add a warning, and --strict turns it into a failure
        "docs": [
            "mkdocs==1.6.1",
            "mkdocs-material==9.8.2",
            "mkdocstrings==1.0.8",
            "mkdocstrings-python==2.0.11",
        ],
    },
    ext_modules=[CMakeExtension("isoloco_kernels._C")] if TOOLS is not None else [],
    cmdclass={"build_ext": BuildCMake, "build_py": BuildPy},
    zip_safe=False,
)
