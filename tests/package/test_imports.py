"""Every module imports on its own, in a fresh interpreter: no hidden dependence on import order."""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys

import pytest

import isoloco_kernels

pytestmark = pytest.mark.slow  # imports every module in a fresh interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _modules() -> list[str]:
    names = ["isoloco_kernels"]
    for info in pkgutil.walk_packages(isoloco_kernels.__path__, "isoloco_kernels."):
        last = info.name.rsplit(".", 1)[-1]
        # __main__ runs the training job; _C is the CUDA extension, a torch op library that
        # _ext.py loads with torch.ops.load_library, not a Python module.
        if last not in ("__main__", "_C"):
            names.append(info.name)
    return sorted(names)


# One fresh interpreter imports torch (not this package: the thing under test) and then forks a child per
# module, which imports only that module: each child starts with no isoloco_kernels module loaded, as a
# fresh interpreter would, without paying torch's import once per module.
_FORKED_IMPORTS = r"""
import multiprocessing as mp, sys, traceback
import torch

def one(name, q):
    try:
        __import__(name)
        q.put((name, 0, ""))
    except BaseException:
        q.put((name, 1, traceback.format_exc()[-2000:]))

ctx = mp.get_context("fork")
bad = []
for name in sys.argv[1:]:
    assert not [m for m in sys.modules if m.startswith("isoloco_kernels")]
    q = ctx.Queue()
    p = ctx.Process(target=one, args=(name, q))
    p.start()
    p.join(300)
    got = q.get(timeout=5) if p.exitcode == 0 else (name, p.exitcode, "the child died")
    if got[1]:
        bad.append(got)
for name, rc, err in bad:
    print(f"FAILED {name} (exit {rc}):\n{err}")
print(f"imported {len(sys.argv) - 1 - len(bad)} of {len(sys.argv) - 1} modules alone")
"""


def test_every_module_imports_alone():
    names = _modules()
    assert {"isoloco_kernels.ops", "isoloco_kernels.optim", "isoloco_kernels.flatten.coefficients"} <= set(names)
    proc = subprocess.run(
        [sys.executable, "-c", _FORKED_IMPORTS, *names], cwd=ROOT, capture_output=True, text=True, timeout=1200
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"imported {len(names)} of {len(names)} modules alone" in proc.stdout, proc.stdout[-6000:]


def test_the_forked_import_check_sees_a_failing_module(tmp_path):
    """The check can fail: a module that raises on import is reported by name."""
    (tmp_path / "broken_mod.py").write_text("import torch\nraise ImportError('no such thing')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-c", _FORKED_IMPORTS, "json", "broken_mod"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert "FAILED broken_mod (exit 1)" in proc.stdout and "no such thing" in proc.stdout, proc.stdout
    assert "imported 1 of 2 modules alone" in proc.stdout


def _imports_of(path: str, package: str) -> set[str]:
    """The package modules a module imports, anywhere in it (imports inside functions too: a lazy
    import only hides a cycle, it does not remove it)."""
    import ast

    out = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")
            mod = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{mod}.{alias.name}"
                out.add(full if _is_module(full) else mod)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("isoloco_kernels"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("isoloco_kernels")}
    return out


def _is_module(name: str) -> bool:
    path = os.path.join(ROOT, *name.split("."))
    return os.path.isdir(path) or os.path.exists(path + ".py")


def import_graph(root: str = ROOT) -> dict[str, set[str]]:
    """module → the package modules it imports; a package's own __init__ importing its
    submodules (to re-export them) is left out, everything else counts."""
    names = _modules()
    graph = {}
    for name in names:
        parts = name.split(".")
        path = os.path.join(root, *parts)
        is_pkg = os.path.isdir(path)
        path = os.path.join(path, "__init__.py") if is_pkg else path + ".py"
        package = name if is_pkg else ".".join(parts[:-1])
        graph[name] = {
            m
            for m in _imports_of(path, package)
            if m in names and m != name and not (is_pkg and m.startswith(name + "."))
        }
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_find_cycle_sees_a_lazy_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


#: The top floor (DESIGN.md, "The house"): the public face and little else; everything else lives in a subpackage.
MAX_TOP_MODULES = 9


def test_the_top_floor_keeps_few_modules():
    top = sorted(f for f in os.listdir(os.path.join(ROOT, "isoloco_kernels")) if f.endswith(".py"))
    assert len(top) <= MAX_TOP_MODULES, f"{len(top)} modules directly in isoloco_kernels/: {top}"
    subpackages = {"compress", "dispatch", "distributed", "flatten", "merges", "optim", "outer", "train", "triton"}
    assert all(os.path.isfile(os.path.join(ROOT, "isoloco_kernels", d, "__init__.py")) for d in subpackages)


@pytest.mark.parametrize(
    "pkg", ["compress", "dispatch", "distributed", "flatten", "merges", "optim", "outer", "train", "triton"]
)
def test_every_subpackage_says_what_lives_there(pkg):
    """Each subpackage's __init__ opens with a docstring: what lives there (and what it may import)."""
    import ast

    path = os.path.join(ROOT, "isoloco_kernels", pkg, "__init__.py")
    doc = ast.get_docstring(ast.parse(open(path, encoding="utf-8").read()))
    assert doc and len(doc) > 80, f"isoloco_kernels/{pkg}/__init__.py has no docstring saying what lives there"


#: The floors of the house, lowest first (DESIGN.md, "The house"): a room imports only rooms on its own floor or below.
FLOORS = {
    "reference": 0,
    "_validate": 0,
    "triton": 1,
    "dispatch": 2,
    "flatten": 3,
    "compress": 3,
    "api": 4,
    "ops": 4,
    "merges": 5,
    "outer": 5,
    "distributed": 6,
    "optim": 7,
    "train": 8,
    "__init__": 9,
}


def arrows_up(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a room to a room on a higher floor (a module's room: its first name under the package)."""

    def room(m: str) -> str:
        parts = m.split(".")
        return parts[1] if len(parts) > 1 else "__init__"

    return sorted(
        f"{a} -> {b}" for a, bs in graph.items() for b in bs if room(a) != room(b) and FLOORS[room(b)] > FLOORS[room(a)]
    )


def test_no_arrow_up():
    graph = import_graph()
    rooms = {m.split(".")[1] if "." in m else "__init__" for m in graph}
    assert rooms <= set(FLOORS), f"rooms without a floor: {sorted(rooms - set(FLOORS))}"
    assert arrows_up(graph) == []


def test_arrows_up_sees_one():
    graph = {"isoloco_kernels.flatten.polar": {"isoloco_kernels.optim.isoloco"}}
    assert arrows_up(graph) == ["isoloco_kernels.flatten.polar -> isoloco_kernels.optim.isoloco"]
