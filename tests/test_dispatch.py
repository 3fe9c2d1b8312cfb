"""dispatch.py: one table per (op, device) chooses the backend; backends() reports that same choice;
every backend sees arguments checked by the one check of its op."""
from __future__ import annotations

import pytest
import torch

import isoloco_kernels as ik
from isoloco_kernels import dispatch


def _fake(name: str, ok: bool, takes: bool = True, log=None):
    def run(*args):
        log.append(name)
    return dispatch.Candidate(name, lambda: (ok, "" if ok else f"{name} is off"),
                              lambda *a: (takes, "" if takes else f"{name} refuses"), run)


def test_select_takes_the_first_available_candidate_that_supports_the_call(monkeypatch):
    log = []
    table = [_fake("a", False, log=log), _fake("b", True, takes=False, log=log), _fake("c", True, log=log),
             _fake("d", True, log=log)]
    monkeypatch.setitem(dispatch.TABLES, ("iso_scale_", "cuda"), table)
    assert dispatch.select("iso_scale_", "cuda", "args").name == "c"
    assert dispatch.select("iso_scale_", "cuda").name == "b"  # no arguments: the first available
    assert [r[:2] for r in dispatch.report("iso_scale_", "cuda")] == [("a", False), ("b", True), ("c", True), ("d", True)]


@pytest.mark.parametrize("key", sorted(dispatch.TABLES), ids=lambda k: f"{k[0]}-{k[1]}")
def test_backends_names_what_select_picks(key):
    op, device = key
    assert ik.backends()[f"{op}[{device}]"].startswith(dispatch.select(op, device).name)


def test_the_cpu_op_runs_what_the_table_selects(monkeypatch):
    """The registered implementation runs select()'s candidate (a recording stand-in here)."""
    log = []
    monkeypatch.setitem(dispatch.TABLES, ("nesterov_outer_", "cpu"), [_fake("first", False, log=log),
                                                                      _fake("second", True, log=log)])
    monkeypatch.setitem(dispatch.TABLES, ("iso_scale_", "cpu"), [_fake("only", True, log=log)])
    p = [torch.zeros(3)]
    torch.ops.isoloco.nesterov_outer_(p, [torch.zeros(3)], [torch.ones(3)], 0.5, 0.9, None)
    x = torch.randn(2, 3)
    torch.ops.isoloco.iso_scale_(x, x.clone())
    assert log == ["second", "only"]


@pytest.mark.parametrize(
    "edit,exc,match",
    [
        pytest.param(lambda a: a["bufs"].__setitem__(0, torch.zeros(3, dtype=torch.float64)), TypeError,
                     r"buf 0 is torch.float64; it must be float32 or the param's dtype \(torch.float16\)",
                     id="buf-dtype"),
        pytest.param(lambda a: a.__setitem__("scales", torch.ones(1, dtype=torch.int32)), TypeError,
                     "scales must be floating point", id="int-scales"),
        pytest.param(lambda a: a.__setitem__("lr", float("nan")), ValueError, "finite", id="nan-lr"),
        pytest.param(lambda a: a["updates"].__setitem__(0, torch.ones(4)), ValueError, "same shape", id="shape"),
    ],
)
def test_nesterov_arguments_are_refused_alike_on_every_table(edit, exc, match, monkeypatch):
    """The op's one check runs before select(): every backend (recording stand-ins here) sees only
    input it accepts, and what is refused is refused on every device's table the same way."""
    log = []
    for key in [k for k in dispatch.TABLES if k[0] == "nesterov_outer_"]:
        monkeypatch.setitem(dispatch.TABLES, key, [_fake("any", True, log=log)])
    args = dict(params=[torch.zeros(3, dtype=torch.float16)], bufs=[torch.zeros(3)], updates=[torch.ones(3, dtype=torch.float16)],
                lr=0.5, momentum=0.9, scales=None)
    edit(args)
    before = [t.clone() for t in args["params"] + args["bufs"]]
    with pytest.raises(exc, match=match):
        torch.ops.isoloco.nesterov_outer_(**args)
    assert log == [] and all(torch.equal(a, b) for a, b in zip(args["params"] + args["bufs"], before))


def test_polar_gemm_triton_is_opt_in(monkeypatch):
    x = torch.randn(4, 6)
    monkeypatch.delenv("ISOLOCO_POLAR_GEMM", raising=False)
    assert dispatch.select("polar_gemm", "cpu", x).name == "torch"
    from isoloco_kernels import triton as tk

    monkeypatch.setenv("ISOLOCO_POLAR_GEMM", "triton")
    want = "experimental triton GEMMs (interpreter)" if tk.usable_for(x) else "torch"
    assert dispatch.select("polar_gemm", "cpu", x).name == want
