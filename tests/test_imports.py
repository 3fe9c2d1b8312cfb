"""Every module imports on its own, in a fresh interpreter: no hidden dependence on import order."""
from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import isoloco_kernels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules() -> list[str]:
    names = ["isoloco_kernels"]
    for info in pkgutil.walk_packages(isoloco_kernels.__path__, "isoloco_kernels."):
        last = info.name.rsplit(".", 1)[-1]
        # __main__ runs the training job; _C is the CUDA extension, a torch op library that
        # _ext.py loads with torch.ops.load_library, not a Python module.
        if last not in ("__main__", "_C"):
            names.append(info.name)
    return sorted(names)


def _import_alone(name: str) -> tuple[str, int, str]:
    proc = subprocess.run(
        [sys.executable, "-c", f"import {name}"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    return name, proc.returncode, proc.stderr[-2000:]


def test_every_module_imports_alone():
    names = _modules()
    assert {"isoloco_kernels.ops", "isoloco_kernels.optim", "isoloco_kernels.coefficients"} <= set(names)
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(_import_alone, names))
    failed = [f"{n} (exit {rc}):\n{err}" for n, rc, err in results if rc != 0]
    assert not failed, "\n\n".join(failed)
