"""norm_mean (isoloco_kernels/merges/norm.py): the mean's direction at the workers' mean Frobenius
norm, per 2-D matrix; the mean for every other tensor. Against its float64 definition
(merges/reference.py, `norm_mean_ref`) on odd shapes and every dtype, its edges (K = 1, a mean that
cancels to zero, values near the dtype's limits), batched buckets, merge_, MergeLoCo and the
reference loop's TrainConfig."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from isoloco_kernels import MergeLoCo, ResultOverflowError
from isoloco_kernels.merges import MERGES, merge, merge_
from isoloco_kernels.merges.reference import merge_ref, norm_mean_ref
from isoloco_kernels.reference import nesterov_ref
from tests.helpers import gen, merge_tol, rel_err

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
# 1×n, n×1, tall, wide, square, a vector, a scalar, a 3-D tensor (the last three: the plain mean)
SHAPES = [(1, 9), (9, 1), (40, 6), (6, 40), (16, 16), (7,), (), (2, 3, 4)]


def _tol(dtype: torch.dtype) -> float:
    """The mean's row of the tolerance table: norm_mean is the mean and two norms, no factorization."""
    return merge_tol("mean", dtype)


def test_norm_mean_is_registered_everywhere_a_merge_is_chosen():
    from isoloco_kernels.train import TrainConfig

    assert "norm_mean" in MERGES and MERGES["norm_mean"] == {}
    TrainConfig(merge="norm_mean").validate()
    MergeLoCo([torch.nn.Parameter(torch.zeros(3, 2))], merge="norm_mean")
    with pytest.raises(TypeError, match=r"merge 'norm_mean': unknown option\(s\) \['sparsity'\]"):
        merge([torch.randn(2, 3, 2)], "norm_mean", sparsity=0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [2, 3, 8])
def test_matches_its_float64_definition(dtype, K):
    for shape in SHAPES:
        x = torch.randn(K, *shape, generator=gen(("norm_mean", K, shape)), dtype=torch.float64).to(dtype)
        out = merge([x], "norm_mean")[0]
        ref = merge_ref(x, "norm_mean")
        assert out.shape == x.shape[1:] and out.dtype == dtype
        assert rel_err(out, ref) <= _tol(dtype), (shape, dtype, rel_err(out, ref))
        if x.ndim != 3:  # not 2-D: the plain mean
            assert torch.equal(out, merge([x], "mean")[0]), (shape, dtype)


def test_the_definition_is_the_mean_direction_at_the_mean_norm():
    """What the float64 reference computes, said directly: same direction as the mean (cosine 1), the
    Frobenius norm of the workers' mean norm, the mean's spectrum up to one factor."""
    x = torch.randn(4, 12, 20, generator=gen("nm-def"), dtype=torch.float64)
    x[2] *= 5.0  # unequal worker norms
    out = norm_mean_ref(x)
    mean = x.mean(0)
    target = torch.stack([d.norm() for d in x]).mean()
    assert abs(float(out.norm() / target) - 1) <= 1e-14
    cosine = float((out * mean).sum() / (out.norm() * mean.norm()))
    assert abs(cosine - 1) <= 1e-14
    ratio = torch.linalg.svdvals(out) / torch.linalg.svdvals(mean)
    assert float(ratio.max() - ratio.min()) <= 1e-12 * float(ratio.max())
    assert float(ratio[0]) > 1.2  # averaging shrank the norm; norm_mean gives it back


def test_restores_the_norm_averaging_takes_away():
    """K independent deltas of equal norm: the mean's norm falls as ~1/√K, norm_mean's stays at theirs."""
    for K in (4, 16):
        x = torch.randn(K, 64, 48, generator=gen(("nm-shrink", K)))
        x = x / x.norm(dim=(1, 2), keepdim=True)  # every worker's norm is 1
        assert abs(float(x.mean(0).norm()) * K**0.5 - 1) <= 0.05
        assert abs(float(merge([x], "norm_mean")[0].norm()) - 1) <= 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_worker_is_the_delta_bit_for_bit(dtype):
    for shape in SHAPES:
        x = torch.randn(1, *shape, generator=gen(("nm-k1", shape)), dtype=torch.float64).to(dtype)
        assert torch.equal(merge([x], "norm_mean")[0], x[0]), (shape, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_mean_that_cancels_is_zero_never_nan(dtype):
    d = torch.randn(5, 4, generator=gen("nm-zero"), dtype=torch.float64).to(dtype)
    cancel = torch.stack([d, -d, d, -d])  # the mean is exactly 0; every worker's norm is not
    other = torch.randn(4, 5, 4, generator=gen("nm-zero-2"), dtype=torch.float64).to(dtype)
    out = merge([cancel, other, torch.zeros(3, 5, 4, dtype=dtype)[:1].expand(4, 5, 4)], "norm_mean")
    assert torch.equal(out[0], torch.zeros(5, 4, dtype=dtype))
    assert torch.equal(out[2], torch.zeros(5, 4, dtype=dtype))
    assert rel_err(out[1], norm_mean_ref(other)) <= _tol(dtype)  # its bucket-mate is unaffected
    assert torch.equal(norm_mean_ref(cancel), torch.zeros(5, 4, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tiny_and_huge_values_are_scaled_not_lost(dtype):
    """The squares behind the norms would underflow (tiny) or overflow (huge) in the dtype; each stack
    is scaled by a power of two first, so the result is the definition's."""
    fi = torch.finfo(dtype)
    base = torch.randn(3, 6, 5, generator=gen(("nm-limits", dtype)), dtype=torch.float64)
    for scale in (fi.tiny * 4, fi.max / 8):
        x = (base * scale).to(dtype)
        out = merge([x], "norm_mean")[0]
        assert torch.isfinite(out).all() and bool(out.abs().amax() > 0)
        want = norm_mean_ref(base) * scale
        err = rel_err(out.double() / scale, want / scale)  # compared at unit scale (the norm would overflow)
        assert err <= _tol(dtype) + (1e-5 if scale < 1 else 0), (scale, err)  # subnormal input digits


def test_a_result_past_the_dtype_max_is_refused_by_name_and_nothing_is_written():
    """‖out‖_F is the workers' mean norm, which can put one entry above float16's max."""
    x = torch.tensor([[[60000.0, 60000.0]], [[60000.0, -60000.0]]], dtype=torch.float16)  # mean [60000, 0]
    before = x.clone()
    with pytest.raises(ResultOverflowError, match=r"merge 'norm_mean': stack 0: the norm-mean result does not fit"):
        merge_([x], "norm_mean")
    assert torch.equal(x, before)


def test_batched_buckets_and_non_contiguous_stacks_match_one_by_one():
    g = gen("nm-batched")
    stacks = [
        torch.randn(4, 16, 12, generator=g),
        torch.randn(4, 12, 16, generator=g).mT,  # non-contiguous, same bucket as stack 0
        torch.randn(4, 16, 12, generator=g, dtype=torch.float64),
        torch.randn(4, 7, generator=g),
        torch.randn(4, 1, 30, generator=g) * 1e3,  # another bucket, another scale
        torch.randn(4, 16, 12, generator=g) * 1e-3,
    ]
    together = merge(stacks, "norm_mean")
    for j, s in enumerate(stacks):
        alone = merge([s], "norm_mean")[0]
        assert torch.allclose(together[j], alone, rtol=1e-6, atol=0), j
        assert rel_err(together[j], merge_ref(s, "norm_mean")) <= _tol(s.dtype), j


def test_bad_input_is_refused_by_name_and_nothing_changes():
    good = torch.randn(4, 6, 5, generator=gen("nm-bad"))
    nan = good.clone()
    nan[3, 0, 2] = float("inf")
    copies = [good.clone(), nan.clone()]
    with pytest.raises(ValueError, match=r"stack 1 .*worker 3.*Inf"):
        merge_([good, nan], "norm_mean")
    assert torch.equal(good, copies[0]) and torch.equal(nan, copies[1])


def test_mergeloco_steps_the_merge_then_nesterov():
    g = gen("nm-optim")
    params = [torch.nn.Parameter(torch.randn(12, 8, generator=g)), torch.nn.Parameter(torch.randn(5, generator=g))]
    p64 = [p.detach().double() for p in params]
    b64 = [torch.zeros_like(p) for p in p64]
    opt = MergeLoCo(params, lr=0.9, momentum=0.7, merge="norm_mean")
    for _ in range(2):
        deltas = [torch.randn(4, *p.shape, generator=g) for p in params]
        opt.step(deltas=deltas)
        for i, d in enumerate(deltas):
            p64[i], b64[i] = nesterov_ref(p64[i], b64[i], merge_ref(d, "norm_mean"), 0.9, 0.7)
    for p, want in zip(params, p64):
        assert rel_err(p, want) <= 1e-5
    assert opt.state_dict()["merge"]["merge"] == "norm_mean"


@pytest.mark.slow
def test_reference_loop_runs_norm_mean():
    from isoloco_kernels.train import Setup, TrainConfig, load_corpus, run_mode

    cfg = TrainConfig(model="tiny", seq_len=16, workers=2, inner_steps=3, rounds=2, batch=2, warmup=1, eval_windows=8)
    cfg = dataclasses.replace(cfg, merge="norm_mean")
    cfg.validate()
    r = run_mode("isoloco-sgd", Setup(cfg, load_corpus(max_bytes=60_000)))
    assert r["final_loss"] is not None and r["final_loss"] < 6.0
