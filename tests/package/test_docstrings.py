"""Every public name's docstring (what docs/api.md renders) says its contract, its errors and gives an
example, and every example runs and prints what it shows."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest

import isoloco_kernels as ik

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MEMBERS = {
    "IsoLoCo": ("step", "state_dict", "load_state_dict"),
    "ShardedIsoLoCo": ("step", "state_dict", "load_state_dict"),
}


def _documented() -> list[tuple[str, object]]:
    out = []
    for name in ik.__all__:
        if name == "__version__":
            continue
        obj = getattr(ik, name)
        out.append((name, obj))
        out += [(f"{name}.{m}", getattr(obj, m)) for m in MEMBERS.get(name, ())]
    return out


@pytest.mark.parametrize("name, obj", _documented(), ids=[n for n, _ in _documented()])
def test_docstring_has_contract_errors_and_example(name, obj):
    doc = inspect.getdoc(obj) or ""
    if inspect.isroutine(obj):
        assert obj.__qualname__.split(".")[0] in (name.split(".")[0], obj.__name__), f"{name}: inherited docstring"
    assert len(doc.split("\n\n")[0]) >= 40, f"{name}: no contract sentence"
    assert "Examples:" in doc and ">>> " in doc, f"{name}: no example"
    is_exception = inspect.isclass(obj) and issubclass(obj, (BaseException, Warning))
    assert is_exception or "Raises:" in doc or "raises nothing" in doc.lower(), f"{name}: errors not said"


# The examples run with a one-rank gloo group (the distributed ones need a default group), in a process
# of its own so that group does not leak into other tests.
_RUN = r"""
import doctest, os, sys, torch, torch.distributed as dist
import isoloco_kernels as ik
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
globs = {"torch": torch, **{n: getattr(ik, n) for n in ik.__all__}}
failed = tried = 0
for name in sys.argv[1:]:
    obj = ik
    for part in name.split("."):
        obj = getattr(obj, part)
    finder, runner = doctest.DocTestFinder(recurse=False), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in finder.find(obj, name, globs=dict(globs)):
        r = runner.run(test)
        failed, tried = failed + r.failed, tried + r.attempted
dist.destroy_process_group()
print(f"examples: {tried} tried, {failed} failed")
sys.exit(1 if failed else 0)
"""


@pytest.mark.slow  # a fresh interpreter with a process group
def test_every_example_runs():
    names = [n for n, _ in _documented()]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-c", _RUN, *names], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    tried = int(proc.stdout.rsplit("examples: ", 1)[1].split()[0])
    assert tried >= 2 * len(names), proc.stdout[-2000:]
