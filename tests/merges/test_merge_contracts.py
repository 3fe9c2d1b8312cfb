"""The merges' contracts at their edges (isoloco_kernels/merges): one worker (K = 1) is each merge's
value for that worker's delta; merge_ is all or nothing; stack_ids are ints; the mean of finite
stacks near the dtype's max is computed without overflow, and an overflow names its merge."""

from __future__ import annotations

import math

import pytest
import torch

import isoloco_kernels.merges as M
from isoloco_kernels import ResultOverflowError
from isoloco_kernels.merges import MERGES, check_stacks, merge, merge_, merge_groups
from isoloco_kernels.merges.reference import keep_mask, merge_ref
from isoloco_kernels.reference import iso_flatten_ref
from tests.helpers import gen, merge_tol, rel_err

SHAPES = [(12, 16), (16, 12), (16, 16), (1, 9), (9, 1), (7,), (), (2, 3, 4)]
DTYPES = [torch.float64, torch.float32, torch.bfloat16]
OPTS = {"ties": {"sparsity": 0.5}, "dare": {"sparsity": 0.5, "seed": 3}}
#: merges/reference.py vs the definitions at K = 1: both float64 on the same (rounded) input, so only
#: float64 SVDs recombined differ (measured ≤ 1e-15)
REF_TOL = 1e-12


# -- K = 1: each merge's value for one worker -------------------------------------------------------


def _trimmed(d: torch.Tensor, sparsity: float) -> torch.Tensor:
    """TIES of one delta: its k = max(1, ⌊(1 − p)·n⌋) largest entries by magnitude, their own sign."""
    d64 = d.double()
    k = max(1, int((1 - sparsity) * d64.numel()))
    cut = torch.topk(d64.abs().flatten(), k).values[-1]
    return torch.where(d64.abs() >= cut, d64, 0)


def _definition(method: str, d: torch.Tensor) -> torch.Tensor:
    """The merge of the one-worker stack [d], from its definition (not merges/reference.py)."""
    d64 = d.double()
    if method in ("mean", "tsv", "norm_mean") or (method in ("iso_c", "iso_cts") and d.ndim != 2):
        return d64  # the mean; TSV-M with ⌊r/1⌋ = r triplets recombines the full SVD; norm_mean: ‖Δ‖/‖Δ‖ = 1
    if method in ("iso_c", "iso_cts"):  # Iso-CTS at K = 1: the common space plus the rest of Δ's own
        return iso_flatten_ref(d64)  # directions, every σ set to their mean: Iso-C of Δ
    if method == "ties":
        return _trimmed(d, OPTS["ties"]["sparsity"])
    p = OPTS["dare"]["sparsity"]
    return d64 * keep_mask(d.shape, p, OPTS["dare"]["seed"], 0, 0) / (1 - p)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", list(MERGES))
def test_one_worker_is_each_merge_of_its_delta(method, dtype):
    for shape in SHAPES:
        x = torch.randn(1, *shape, generator=gen(("k1", method, shape)), dtype=torch.float64).to(dtype)
        out = merge([x], method, **OPTS.get(method, {}))[0]
        assert out.shape == x.shape[1:] and out.dtype == dtype
        want = _definition(method, x[0])
        ref = merge_ref(x, method, **OPTS.get(method, {}))  # the float64 reference at K = 1 too
        tol = merge_tol(method, dtype)
        assert rel_err(ref, want) <= REF_TOL, (method, shape, rel_err(ref, want))
        assert rel_err(out, want) <= tol, (method, shape, dtype, rel_err(out, want), tol)
        if method in ("mean", "ties", "norm_mean") or x[0].ndim != 2 and method != "dare":
            assert torch.equal(out, want.to(dtype)), (method, shape, dtype)  # exact: nothing rounds


def test_one_worker_in_place_in_groups_and_checks():
    x = torch.randn(1, 8, 6, generator=gen("k1-inplace"))
    want = merge([x], "iso_cts")[0]
    (slot,) = merge_([x], "iso_cts")
    assert slot.data_ptr() == x.data_ptr() and torch.equal(slot, want)
    assert check_stacks([torch.randn(1, 3), torch.randn(1)]) == 1
    stacks = {0: torch.randn(1, 5, 4, generator=gen("k1-groups")), 1: torch.randn(1, 3)}
    for method in MERGES:
        got = merge_groups(stacks, {0, 1}, method, OPTS.get(method, {}), step=2)
        assert set(got) == {0, 1} and all(torch.isfinite(t).all() for t in got.values())
        if method in ("mean", "iso_c", "norm_mean", "tsv", "iso_cts"):  # a vector: the mean, i.e. the delta
            assert torch.equal(got[1], stacks[1][0]), method
    with pytest.raises(ValueError, match=r"stack 0 .*K = 0"):
        merge([torch.randn(0, 4, 4)], "tsv")


# -- merge_: every check of every stack before the first write --------------------------------------


@pytest.mark.parametrize("make", ["leaf", "view of a leaf"])
def test_merge_in_place_refuses_a_stack_that_requires_grad_before_writing_any(make):
    g = gen(("grad", make))
    first = torch.randn(3, 6, 5, generator=g)
    w = torch.randn(3, 6, 5, generator=g, requires_grad=True)
    second = w if make == "leaf" else w.view(3, 6, 5)
    before = first.clone()
    with pytest.raises(RuntimeError, match=r"merge_: stack 1 requires grad"):
        merge_([first, second], "mean")
    assert torch.equal(first, before)
    assert torch.equal(w.detach(), second.detach())
    with torch.no_grad():  # under no_grad both are written
        merge_([first, second], "mean")
    assert torch.equal(first[0], before.mean(0)) and not torch.equal(w[0].detach(), w[1].detach())


# -- stack_ids ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ids,pos,shown", [([0.0, 0.9], 0, "0.0"), ([0, 0.9], 1, "0.9"), ([True, 1], 0, "True")])
def test_stack_ids_must_be_ints(ids, pos, shown):
    x = torch.randn(3, 6, 5, generator=gen("ids"))
    with pytest.raises(TypeError, match=rf"stack_ids\[{pos}\] .*{shown}"):
        merge([x, x.clone()], "dare", stack_ids=ids)
    before = x.clone()
    with pytest.raises(TypeError, match=rf"stack_ids\[{pos}\]"):
        merge_([x, x.clone()], "dare", stack_ids=ids)
    assert torch.equal(x, before)
    with pytest.raises(TypeError, match="stack_ids must be"):
        merge([x], "dare", stack_ids=3)
    with pytest.raises(ValueError, match="1 stack_ids for 2 stacks"):
        merge([x, x], "dare", stack_ids=[0])


def test_integer_stack_ids_of_any_integer_type_draw_their_stream():
    x = torch.randn(2, 30, generator=gen("ids-ok"))
    want = merge([x, x], "dare", sparsity=0.5, stack_ids=[4, 7])
    for ids in ([torch.tensor(4), torch.tensor(7)], (4, 7), range(4, 10, 3)):
        got = merge([x, x], "dare", sparsity=0.5, stack_ids=ids)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not torch.equal(want[0], want[1])  # two ids, two draws


# -- the mean near the dtype's max; overflow errors name their merge -------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16])
@pytest.mark.parametrize("method", ["mean", "iso_c", "tsv"])
def test_mean_of_finite_stacks_near_the_max_fits(dtype, method):
    top = torch.finfo(dtype).max
    g = gen(("near-max", dtype))
    x = (top * (0.9 + 0.1 * torch.rand(4, 5, generator=g, dtype=torch.float64))).to(dtype)
    x[1, 2] = -x[1, 2]  # one mixed-sign column: its mean is small
    stacks = [x, x[:, :3].clone()] if method == "mean" else [x]  # iso_c, tsv: not 2-D, so the mean
    for s, out in zip(stacks, merge(stacks, method)):
        want = (s.double() / s.shape[0]).sum(0)  # each term divided first: float64's own max too
        assert torch.isfinite(out).all()
        err = rel_err(out.double() / top, want / top)  # scaled: a norm of these would overflow
        assert err <= merge_tol("mean", dtype), err


def test_mean_of_ordinary_stacks_is_torch_mean_bit_for_bit():
    g = gen("mean-bits")
    for dtype in (torch.float32, torch.float64):
        x = torch.randn(5, 33, 7, generator=g, dtype=dtype)
        assert torch.equal(merge([x], "mean")[0], x.mean(0))


#: each merge's name as its messages show it to a user
SHOWN = dict(
    mean="mean", iso_c="Iso-C", norm_mean="norm-mean", tsv="TSV-M", iso_cts="Iso-CTS", ties="TIES", dare="DARE"
)


@pytest.mark.parametrize("method", list(MERGES))
def test_an_overflow_names_the_merge_that_produced_it(method, monkeypatch):
    """The message names the merge that produced the result, by the name a user knows it by (SHOWN)."""
    x = torch.randn(2, 4, 3, generator=gen("ovf-name"))
    v = torch.randn(2, 5, generator=gen("ovf-name-1d"))
    real = M._compute

    def huge(stacks, *args):  # a result past float32's max in every stack
        return [r * math.inf for r in real(stacks, *args)]

    monkeypatch.setattr(M, "_compute", huge)
    with pytest.raises(ResultOverflowError) as e:
        merge([v, x], method)
    msg = str(e.value)
    assert "stack 0" in msg and f"merge {method!r}" in msg
    one_d = SHOWN[method] if method in ("ties", "dare") else "mean"  # not 2-D: the mean under the others
    assert f"the {one_d} result" in msg and ("Iso-C" not in msg or method == "iso_c"), msg
    with pytest.raises(ResultOverflowError, match=f"stack 0: the {SHOWN[method]} result"):
        merge([x], method)


def test_real_overflows_name_their_merge():
    big = torch.full((2, 4, 4), 3.0e38)
    with pytest.raises(ResultOverflowError, match=r"merge 'dare': stack 0: the DARE result does not fit"):
        merge([big], "dare", sparsity=0.5, seed=3)
    with pytest.raises(ResultOverflowError, match=r"merge 'ties': stack 0: the TIES result does not fit"):
        merge([big], "ties", sparsity=0.5, rescale=True)


def test_merge_of_one_worker_is_its_definition():
    """K = 1: each merge has a value for one worker (the mean: the delta itself)."""
    d = torch.randn(1, 6, 4, generator=gen("k1"))
    assert torch.equal(merge([d], "mean")[0], d[0])
