"""The build: extension status, CUDA kernel registration, NVRTC-cleanliness of the kernel sources.

Runs without a GPU. When the extension was built (ISOLOCO_CUDA=1), its CUDA kernels must be
registered for both ops; the kernel sources must compile with NVRTC alone (no CUDA headers), which
is what the CuPy path (isoloco_kernels/dispatch/_cupy.py) relies on.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

import isoloco_kernels
from isoloco_kernels.dispatch import _cupy, _ext

OPS = ("csrc_iso_scale_", "csrc_nesterov_outer_")  # the extension's kernels, behind the public ops


def test_status_is_reported():
    status = isoloco_kernels.backends()["cuda_extension"]
    assert status == _ext.STATUS
    if _ext.LOADED:
        assert status.startswith("loaded ") and os.path.isfile(status[len("loaded ") :])
    else:
        assert status.startswith(("not built", "disabled", "found ")), status


@pytest.mark.skipif(not _ext.LOADED, reason=f"CUDA extension not loaded: {_ext.STATUS}")
def test_extension_registers_cuda_kernels():
    for op in OPS:
        assert _ext.has_kernel(op, "CUDA"), f"isoloco::{op} has no CUDA kernel from {_ext.STATUS}"
    assert isoloco_kernels.backends()["iso_scale_[cuda]"].startswith("csrc (compiled extension)")


def test_has_kernel_is_false_for_unknown_ops():
    assert not _ext.has_kernel("no_such_op", "CUDA")


def test_absent_extension_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(_ext, "_HERE", str(tmp_path))
    monkeypatch.setattr(_ext, "LOADED", False)
    monkeypatch.setattr(_ext, "STATUS", "")
    assert _ext.load() is False
    assert _ext.STATUS.startswith("not built") and str(tmp_path) in _ext.STATUS
    if torch.version.cuda is None:
        assert "CPU-only" in _ext.STATUS


def test_unloadable_library_is_a_status_not_an_exception(monkeypatch, tmp_path):
    (tmp_path / "_C.so").write_bytes(b"not an ELF file")
    monkeypatch.setattr(_ext, "_HERE", str(tmp_path))
    monkeypatch.setattr(_ext, "LOADED", False)
    monkeypatch.setattr(_ext, "STATUS", "")
    assert _ext.load() is False
    assert _ext.STATUS.startswith("found _C.so but could not load it"), _ext.STATUS


def test_disable_switch(monkeypatch):
    monkeypatch.setenv("ISOLOCO_DISABLE_EXT", "1")
    monkeypatch.setattr(_ext, "LOADED", False)
    monkeypatch.setattr(_ext, "STATUS", "")
    assert _ext.load() is False and "ISOLOCO_DISABLE_EXT" in _ext.STATUS


@pytest.mark.parametrize("L", [1, 3, 4, 5, 8191, 8192, 8193, 65536 * 3 + 1, 4096 * 4096, 10**8 + 7])
def test_cupy_launch_plan_covers_each_matrix(L):
    nchunks, chunk_len = _cupy.launch_plan(L)
    assert 1 <= nchunks <= 256 and chunk_len % _cupy.VEC == 0
    assert (nchunks - 1) * chunk_len < L <= nchunks * chunk_len  # every chunk non-empty, all covered


def test_kernel_sources_are_found():
    d = _cupy.kernel_dir()
    assert d is not None
    for name in ("common.cuh", "iso_scale.cuh", "nesterov.cuh"):
        assert os.path.isfile(os.path.join(d, name))


def test_kernel_code_is_self_contained():
    code = _cupy.kernel_code("iso_scale.cuh", "nesterov.cuh")
    assert "#include" not in code  # local includes inlined, and no others exist
    assert code.count("struct half_t") == 1  # common.cuh once, though both headers include it
    assert "iso_scale_partial" in code and "nesterov_outer" in code


def _instantiations() -> list[str]:
    """Template instantiations as _cupy.py names them, every storage type in every role."""
    st = _cupy._STORAGE
    dts = list(st)
    names = []
    for k, xd in enumerate(dts):
        c = "double" if xd == torch.float64 else "float"
        qd = dts[(k + 1) % len(dts)]
        names.append(f"ik::iso_scale_partial<{st[xd]}, {st[qd]}, {c}>")
        names.append(f"ik::iso_scale_apply<{st[xd]}, {st[qd]}, {c}>")
        names.append(f"ik::nesterov_outer<{st[xd]}, {st[xd]}, {st[qd]}, {c}>")
    return names


def _nvrtc_compile(names: list[str], arch: str) -> tuple[bytes, dict[str, str]]:
    """Compile the kernel source _cupy.py hands CuPy, for `names`, with NVRTC and no include path
    (so it needs no CUDA or C++ header); returns (cubin or PTX, lowered names)."""
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="cuda.bindings (NVRTC) is not installed")
    ok = nvrtc.nvrtcResult.NVRTC_SUCCESS
    src = _cupy.kernel_code("iso_scale.cuh", "nesterov.cuh").encode()
    err, prog = nvrtc.nvrtcCreateProgram(src, b"isoloco_nvrtc_check.cu", 0, [], [])
    assert err == ok
    try:
        for n in names:
            (err,) = nvrtc.nvrtcAddNameExpression(prog, n.encode())
            assert err == ok, n
        opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17"]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        # Writable buffers: `b" " * 1` is CPython's shared one-byte object, and NVRTC writing its
        # NUL into it would change b" " for the whole process.
        log = bytearray(size)
        nvrtc.nvrtcGetProgramLog(prog, log)
        assert err == ok, bytes(log).decode(errors="replace")
        lowered = {}
        for n in names:
            err, low = nvrtc.nvrtcGetLoweredName(prog, n.encode())
            assert err == ok and low.startswith(b"_Z"), n
            lowered[n] = low.decode()
        get_size, get = (
            (nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN)
            if arch.startswith("sm_")
            else (nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX)
        )
        _, size = get_size(prog)
        out = bytearray(size)
        (err,) = get(prog, out)
        assert err == ok and size > 0
        return bytes(out), lowered
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernel_sources_compile_with_nvrtc(arch):
    cubin, lowered = _nvrtc_compile(_instantiations(), arch)
    assert cubin[:4] == b"\x7fELF"
    for name, low in lowered.items():  # every instantiation is in the cubin under its mangled name
        assert low.encode() in cubin, name


def test_kernels_use_vector_loads_and_stores():
    """With aligned operands the kernels move kVec elements per instruction (compiled to PTX)."""
    want = {  # instantiation -> vector instructions its PTX must hold
        "ik::iso_scale_partial<float, float, float>": [r"ld\.global\.nc\.v4\.f32"],
        "ik::iso_scale_apply<ik::bf16_t, float, float>": [r"ld\.global(\.nc)?\.v4\.f32", r"st\.global\.v4\.u16"],
        # table addresses are generic: ld/st without a state space
        "ik::nesterov_outer<float, float, ik::bf16_t, float>": [r"ld\.v4\.f32", r"st\.v4\.f32", r"ld\.v4\.u16"],
        "ik::nesterov_outer<double, double, double, double>": [r"ld\.v2\.f64", r"st\.v2\.f64"],
    }
    ptx, lowered = _nvrtc_compile(list(want), "compute_90")
    text = ptx.decode(errors="replace")
    for name, patterns in want.items():
        start = text.index(f".entry {lowered[name]}(")
        end = text.find(".entry ", start + 1)
        body = text[start : end if end > 0 else None]
        for pat in patterns:
            assert re.search(pat, body), f"{name}: no {pat} in its PTX"


# ---------------------------------------------------------------------------------------------
# The GPU code the extension carries, and the CuPy wheel for torch's CUDA.


@pytest.mark.skipif(not _ext.LOADED, reason=f"CUDA extension not loaded: {_ext.STATUS}")
def test_extension_records_the_gpu_code_it_carries():
    """The library says which cubins/PTX it holds (dispatch reads it to fall back on other GPUs):
    the default build ("8.0;9.0+PTX") holds sm_80 and sm_90 cubins and sm_90 PTX."""
    archs = _ext.built_archs()
    assert archs and all(re.fullmatch(r"(sm|compute)_\d+[af]?", a) for a in archs), archs
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        assert set(archs) == {"sm_80", "sm_90", "compute_90"}


def test_default_arch_list_ships_ptx():
    """setup.py and CMakeLists.txt agree on a default arch list that ends in PTX (newer GPUs
    JIT-compile it instead of finding no kernel image)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    setup_default = re.search(r'DEFAULT_ARCHS = "([^"]+)"', open(os.path.join(root, "setup.py")).read()).group(1)
    cmake_default = re.search(
        r'set\(TORCH_CUDA_ARCH_LIST "([^"]+)"\)', open(os.path.join(root, "CMakeLists.txt")).read()
    ).group(1)
    assert setup_default == cmake_default and setup_default.split(";")[-1].endswith("+PTX")


def _setup_function(name: str):
    """One function of setup.py, without running setup()."""
    import ast

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tree = ast.parse(open(os.path.join(root, "setup.py")).read())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    ns: dict = {}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "setup.py", "exec"), ns)
    return ns[name]


@pytest.mark.parametrize("cuda,wheel", [("12.8", "cupy-cuda12x"), ("13.0", "cupy-cuda13x"), (None, "cupy-cuda13x")])
def test_cupy_extra_follows_torchs_cuda(monkeypatch, cuda, wheel):
    monkeypatch.setattr(torch.version, "cuda", cuda)
    assert _setup_function("cupy_wheel")() == wheel


def test_cupy_extra_without_torch_in_the_build(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    assert _setup_function("cupy_wheel")() == "cupy-cuda13x"


def test_missing_cupy_names_the_wheel_for_torchs_cuda(monkeypatch):
    import importlib.util
    import sys

    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("cupy is installed here")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "12.6")
    monkeypatch.setitem(sys.modules, "cupy", None)
    ok, why = _cupy.available.__wrapped__()
    assert not ok and "pip install cupy-cuda12x" in why


def _shared_lib(tmp_path, body: str) -> str:
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a stand-in library")
    src, lib = tmp_path / "lib.c", tmp_path / "lib.so"
    src.write_text(body)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return str(lib)


def test_built_archs_reads_the_record_from_the_library(tmp_path, monkeypatch):
    """What csrc/iso_scale.cu exports (isoloco_cuda_archs) is what built_archs() returns; a
    library without the record gives None (then only the sm_80 floor is checked)."""
    with_record = _shared_lib(tmp_path, 'const char* isoloco_cuda_archs(void) { return "sm_80,sm_90,compute_90"; }\n')
    monkeypatch.setattr(_ext, "PATH", with_record)
    assert _ext.built_archs() == ("sm_80", "sm_90", "compute_90")
    other = tmp_path / "old"
    other.mkdir()
    monkeypatch.setattr(_ext, "PATH", _shared_lib(other, "int unrelated(void) { return 0; }\n"))
    assert _ext.built_archs() is None
    monkeypatch.setattr(_ext, "PATH", None)
    assert _ext.built_archs() is None
