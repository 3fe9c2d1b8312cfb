"""Per-worker weights in every merge (`merge(..., weights=)`, isoloco_kernels/merges/options.py): equal
weights are the unweighted merge bit for bit, a zero weight is that worker dropped (K' counts the
workers left), unequal weights match each merge's float64 weighted definition (merges/reference.py),
and bad weights are refused by name with nothing written."""

from __future__ import annotations

import math

import pytest
import torch

from isoloco_kernels.merges import MERGES, merge, merge_
from isoloco_kernels.merges.reference import merge_ref
from tests.helpers import gen, merge_tol, rel_err
from tests.merges.test_merges import gap_cond

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(12, 16), (16, 12), (1, 9), (9, 1), (7,), (), (2, 3, 4)]
OPTS = {"ties": {"sparsity": 0.5}, "dare": {"sparsity": 0.5, "seed": 3}}
# merges whose weighted form is the unweighted merge of the reweighted workers K·ω_i·Δ_i (TIES's disjoint
# mean divides by the agreeing weight, not by a count, so it is not)
REWEIGHTABLE = ("mean", "iso_c", "norm_mean", "tsv", "iso_cts", "dare")


def _stack(K, shape, dtype, key):
    return torch.randn(K, *shape, generator=gen(key), dtype=torch.float64).to(dtype)


def _tol(method, x, omega=None):
    """The table's tolerance, with the spectral merges' gap term taken on the reweighted workers."""
    x64 = x.double()
    if omega is not None:
        x64 = x64 * (len(omega) * torch.as_tensor(omega, dtype=torch.float64)).reshape(-1, *[1] * (x.ndim - 1))
    return merge_tol(method, x.dtype, gap_cond(x64, method))


# -- equal weights: the unweighted merge, bit for bit ------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", list(MERGES))
def test_equal_weights_are_the_unweighted_merge_bit_for_bit(method, dtype):
    K = 4
    stacks = [_stack(K, s, dtype, ("eq", method, s)) for s in SHAPES]
    want = merge(stacks, method, **OPTS.get(method, {}))
    for w in ([1.0] * K, [0.25] * K, [7] * K, torch.full((K,), 3.0), (2.5,) * K):
        got = merge(stacks, method, weights=w, **OPTS.get(method, {}))
        for j, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), (method, dtype, w, SHAPES[j])


# -- unequal weights: each merge's weighted definition ------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", list(MERGES))
def test_weighted_merge_matches_its_float64_definition(method, dtype):
    weights = [1.0, 3.0, 0.5, 2.0]
    omega = [w / sum(weights) for w in weights]
    for shape in SHAPES:
        x = _stack(4, shape, dtype, ("w", method, shape))
        out = merge([x], method, weights=weights, **OPTS.get(method, {}))[0]
        ref = merge_ref(x, method, weights=weights, **OPTS.get(method, {}))
        assert out.shape == x.shape[1:] and out.dtype == dtype
        tol = _tol(method, x, omega)
        assert rel_err(out, ref) <= tol, (method, shape, dtype, rel_err(out, ref), tol)
        if shape != ():  # the weights change the result (a scalar's TIES may keep one worker either way)
            assert rel_err(ref, merge_ref(x, method, **OPTS.get(method, {}))) > 1e-3, (method, shape)


@pytest.mark.parametrize("method", REWEIGHTABLE)
def test_weighted_is_the_unweighted_merge_of_the_reweighted_workers(method):
    """The weighted rules say: replace each worker's share Δ_i/K by ω_i·Δ_i. For these merges that is the
    unweighted merge of K·ω_i·Δ_i, computed here without the weights at all."""
    weights = torch.tensor([1.0, 3.0, 0.5, 2.0], dtype=torch.float64)
    omega = weights / weights.sum()
    for shape in [(12, 16), (16, 12), (7,)]:
        x = _stack(4, shape, torch.float64, ("rew", method, shape))
        scaled = x * (4 * omega).reshape(-1, *[1] * (x.ndim - 1))
        got = merge([x], method, weights=weights, **OPTS.get(method, {}))[0]
        want = merge_ref(scaled, method, **OPTS.get(method, {}))
        assert rel_err(got, want) <= _tol(method, scaled), (method, shape, rel_err(got, want))


def test_weighted_ties_elects_the_sign_of_the_weighted_mass():
    """One entry, three workers +1, +1, −3: unweighted the mass is −1 (elect −, result −3); weighted 3, 3, 1
    it is +3/7 (elect +, result the weighted mean of the agreeing +1's: 1)."""
    x = torch.tensor([[1.0, 2.0], [1.0, -1.0], [-3.0, -1.5]])
    # entry 2: unweighted mass −0.5 (elect −, the mean of −1 and −1.5); weighted (6 − 3 − 1.5)/7 > 0: worker 0's 2
    assert torch.equal(merge([x], "ties", sparsity=0.0)[0], torch.tensor([-3.0, -1.25]))
    got = merge([x], "ties", sparsity=0.0, weights=[3, 3, 1])[0]
    assert torch.equal(got, torch.tensor([1.0, 2.0]))
    assert torch.equal(merge_ref(x, "ties", sparsity=0.0, weights=[3, 3, 1]), got.double())


# -- a zero weight: that worker dropped ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", list(MERGES))
def test_a_zero_weight_is_that_worker_dropped(method, dtype):
    opts = OPTS.get(method, {})
    for shape in SHAPES:
        x = _stack(4, shape, dtype, ("zero", method, shape))
        for drop in (1, 3):
            w = [1.0] * 4
            w[drop] = 0.0
            keep = [k for k in range(4) if k != drop]
            got = merge([x], method, weights=w, **opts)[0]
            alone = merge([x[keep]], method, **opts)[0]
            ref = merge_ref(x, method, weights=w, **opts)
            assert rel_err(got, ref) <= _tol(method, x[keep]), (method, shape, drop)
            if method != "dare" or drop == 3:  # DARE: the workers after a dropped one keep their stream index
                assert torch.equal(got, alone), (method, shape, drop)
            # unequal weights on the rest: the weighted merge of the K − 1 stack
            w2 = [2.0, 1.0, 1.0, 0.5]
            w2[drop] = 0.0
            got2 = merge([x], method, weights=w2, **opts)[0]
            if method != "dare" or drop == 3:
                assert torch.equal(got2, merge([x[keep]], method, weights=[w2[k] for k in keep], **opts)[0])
            assert rel_err(got2, merge_ref(x, method, weights=w2, **opts)) <= _tol(method, x[keep], None) * 4


def test_dare_keeps_each_workers_stream_index_when_one_is_dropped():
    x = _stack(4, (40,), torch.float64, "dare-ids")
    got = merge([x], "dare", sparsity=0.5, seed=5, weights=[1, 0, 1, 1])[0]
    renumbered = merge([x[[0, 2, 3]]], "dare", sparsity=0.5, seed=5)[0]
    want = merge_ref(x, "dare", sparsity=0.5, seed=5, weights=[1, 0, 1, 1])
    assert rel_err(got, want) <= 1e-12
    assert not torch.equal(got, renumbered)  # workers 2, 3 draw their own drops, not 1's and 2's


@pytest.mark.parametrize("method", ["tsv", "iso_cts"])
def test_the_per_worker_budget_counts_the_workers_with_weight(method):
    """TSV-M keeps ⌊r/K'⌋ triplets of each of the K' workers with weight > 0: r = 10, K = 4 → 2 each
    (rank 8); one weight 0 → K' = 3, 3 each (rank 9). Iso-CTS's task share likewise (its size is K'·t)."""
    x = _stack(4, (10, 14), torch.float64, ("budget", method))
    full = merge([x], method)[0]
    dropped = merge([x], method, weights=[1, 1, 0, 1])[0]
    assert torch.equal(dropped, merge([x[[0, 1, 3]]], method)[0])
    if method == "tsv":
        rank = [int((torch.linalg.svdvals(t) > 1e-10 * torch.linalg.svdvals(t)[0]).sum()) for t in (full, dropped)]
        assert rank == [8, 9], rank


def test_weights_in_every_stack_and_bucket_are_the_same_workers():
    g = gen("w-batched")
    stacks = [
        torch.randn(3, 16, 12, generator=g),
        torch.randn(3, 12, 16, generator=g).mT,
        torch.randn(3, 7, generator=g, dtype=torch.float64),
        torch.randn(3, 16, 12, generator=g),
    ]
    w = torch.tensor([0.2, 1.0, 0.7])
    for method in MERGES:
        together = merge(stacks, method, weights=w)
        for j, s in enumerate(stacks):
            alone = merge([s], method, weights=w, stack_ids=[j])[0]
            assert torch.allclose(together[j], alone, rtol=1e-6, atol=1e-7), (method, j)


def test_weights_of_any_magnitude_are_normalized_without_overflow():
    x = _stack(3, (6, 5), torch.float32, "w-mag")
    want = merge([x], "iso_c", weights=[2.0, 1.0, 4.0])
    for w in ([8e307, 4e307, 1.6e308], [2e-310, 1e-310, 4e-310], [2, 1, 4]):  # the first sums past the max
        got = merge([x], "iso_c", weights=w)
        assert rel_err(got[0], want[0]) <= 1e-6, w


def test_weighted_mean_near_the_max_fits():
    top = torch.finfo(torch.float32).max
    x = torch.full((2, 5), top * 0.99)
    out = merge([x], "mean", weights=[1.0, 3.0])[0]
    assert torch.isfinite(out).all() and rel_err(out.double() / top, torch.full((5,), 0.99)) <= 1e-6


def test_weights_as_tensor_sequence_numpy_and_0d_tensors():
    np = pytest.importorskip("numpy")
    x = _stack(3, (4, 3), torch.float32, "w-kinds")
    want = merge([x], "tsv", weights=[1.0, 2.0, 3.0])[0]
    for w in (torch.tensor([1, 2, 3]), (1, 2, 3), np.array([1.0, 2.0, 3.0]), [torch.tensor(1.0), 2, 3.0]):
        assert torch.equal(merge([x], "tsv", weights=w)[0], want), type(w)


# -- refused by name, nothing written --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "weights, error, match",
    [
        ([1.0, -0.5, 1.0], ValueError, r"weights\[1\] = -0\.5 \(worker 1's weight\) is negative"),
        ([1.0, math.nan, 1.0], ValueError, r"weights\[1\] = nan \(worker 1's weight\) must be finite"),
        ([math.inf, 1.0, 1.0], ValueError, r"weights\[0\] = inf .* must be finite"),
        ([1.0, 1.0], ValueError, r"2 weights for K = 3 workers"),
        ([1.0, 1.0, 1.0, 1.0], ValueError, r"4 weights for K = 3 workers"),
        ([0, 0.0, 0], ValueError, r"every weight is 0 .*skip this round's outer step"),
        (torch.zeros(3), ValueError, r"every weight is 0"),
        (2.0, TypeError, r"weights must be a 1-D tensor or a sequence .* got float"),
        ("abc", TypeError, r"weights must be .* got str"),
        ({0: 1.0}, TypeError, r"weights must be .* got dict"),
        ([1.0, "a", 1.0], TypeError, r"weights\[1\] must be a real number .* got 'a'"),
        ([1.0, None, 1.0], TypeError, r"weights\[1\] must be a real number .* got None"),
        ([True, 1.0, 1.0], TypeError, r"weights\[0\] must be a real number .* got True"),
        ([1.0, 1j, 1.0], TypeError, r"weights\[1\] must be a real number"),
        (torch.ones(3, 1), ValueError, r"got a tensor of shape \(3, 1\)"),
        (torch.ones(3, dtype=torch.bool), TypeError, r"got a tensor of dtype torch.bool"),
        (torch.tensor([1.0, float("nan"), 2.0]), ValueError, r"weights\[1\] = nan"),
    ],
)
def test_bad_weights_are_refused_by_name_and_nothing_is_written(weights, error, match):
    x = _stack(3, (6, 5), torch.float32, "w-bad")
    v = _stack(3, (4,), torch.float32, "w-bad-1d")
    before = [x.clone(), v.clone()]
    for method in ("mean", "tsv", "ties"):
        with pytest.raises(error, match=rf"^merge: (weights must be .*)?{match}"):
            merge_([x, v], method, weights=weights)
        assert torch.equal(x, before[0]) and torch.equal(v, before[1])


def test_a_zero_weight_workers_nan_is_still_refused():
    """Every worker's Δ is checked, a zero-weight one's too: NaN never passes silently."""
    x = _stack(3, (6, 5), torch.float32, "w-nan")
    x[1, 2, 2] = float("nan")
    before = x.clone()
    with pytest.raises(ValueError, match=r"stack 0 .*worker 1.*NaN"):
        merge_([x], "mean", weights=[1.0, 0.0, 1.0])
    assert torch.equal(x.nan_to_num(), before.nan_to_num())
