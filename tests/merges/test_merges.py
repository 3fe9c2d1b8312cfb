"""The five merges (isoloco_kernels/merges): batched ops vs their float64 definitions
(merges/reference.py), vs the official IsoLoCo code's outputs (tests/data/merges_official.pt,
provenance in tests/data/merges_official.md), and the failure contract."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from isoloco_kernels import ResultOverflowError
from isoloco_kernels.merges import MERGES, merge, merge_
from isoloco_kernels.merges.reference import keep_mask, merge_ref, mix32, sparse_ref, stream_key, task_share
from isoloco_kernels.merges.sparse import mix32_tensor
from tests.helpers import captured_pseudo_gradients, gen, merge_tol, rel_err, spectrum, with_spectrum

FIXTURE = Path(__file__).parents[1] / "data" / "merges_official.pt"
SPECTRAL = ("iso_c", "tsv", "iso_cts")
SHAPES = [(12, 16), (16, 12), (16, 16), (1, 9), (9, 1), (7,), (), (2, 3, 4)]


def _kappa(a: torch.Tensor) -> float:
    s = torch.linalg.svdvals(a)
    s = s[s > 1e-12 * s[0]]
    return float(s[0] / s[-1])


def gap_cond(x: torch.Tensor, method: str) -> float:
    """What bounds a spectral merge's error relative to eps: σ_1 / (the gap at each truncation it
    makes) (Davis–Kahan) and the condition number of the concatenated U and V it orthogonalizes (a
    polar factor's sensitivity); the largest over the stack; 1 for merges without either."""
    if method not in ("tsv", "iso_cts") or x.ndim != 3:
        return 1.0
    K, m, n = x.shape
    r = min(m, n)
    x64 = x.to(torch.float64)
    if method == "tsv":
        k = max(1, r // K)
        svds = [torch.linalg.svd(d, full_matrices=False) for d in x64]
        cuts = [(s, k) for _, s, _ in svds]
        u = torch.cat([a[:, :k] for a, _, _ in svds], 1)
        v = torch.cat([b[:k].mT for _, _, b in svds], 1)
    else:
        common, per = task_share(r, K, 0.8)
        uc, sc, vh = torch.linalg.svd(x64.mean(0), full_matrices=False)
        cuts = [(sc, common)]
        us, vs = [uc[:, :common]], [vh[:common].mT]
        for d in x64 / K:
            ut, st, vt = torch.linalg.svd(d - us[0] @ (us[0].mT @ d), full_matrices=False)
            cuts.append((st, per))
            us.append(ut[:, :per])
            vs.append(vt[:per].mT)
        u, v = torch.cat(us, 1), torch.cat(vs, 1)
    worst = max(1.0, _kappa(u), _kappa(v))
    for s, k in cuts:
        if 0 < k < r:
            worst = max(worst, float(s[0]) / max(float(s[k - 1] - s[k]), 1e-300))
    return worst


def check(x: torch.Tensor, method: str, **opts) -> None:
    out = merge([x], method, **opts)[0]
    ref = merge_ref(x, method, **opts)
    assert out.shape == x.shape[1:] and out.dtype == x.dtype
    tol = merge_tol(method, x.dtype, gap_cond(x, method))
    assert rel_err(out, ref) <= tol, (method, tuple(x.shape), x.dtype, rel_err(out, ref), tol)


@pytest.mark.parametrize("method", list(MERGES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K", [2, 4])
def test_every_merge_matches_its_definition(method, dtype, K):
    for shape in SHAPES:
        x = torch.randn(K, *shape, generator=gen((method, K, shape)), dtype=torch.float64).to(dtype)
        check(x, method)


@pytest.mark.parametrize("method", ["tsv", "iso_cts", "ties", "dare", "iso_c"])
def test_k8_wide_and_tall_float32(method):
    for shape in [(24, 40), (40, 24), (32, 32)]:
        x = torch.randn(8, *shape, generator=gen((method, 8, shape)))
        check(x, method)


@pytest.mark.parametrize("method", SPECTRAL)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ill_conditioned_and_rank_deficient(method, dtype):
    g = gen(("illcond", method, dtype))
    for kind, cond in (("geometric", 1e4), ("geometric", 1e6)):
        base = with_spectrum(1, 24, 32, spectrum(kind, 24, cond), g)[0]
        x = torch.stack([base + 1e-3 * torch.randn(24, 32, generator=g, dtype=torch.float64) for _ in range(4)])
        check(x.to(dtype), method)
    low = torch.stack(
        [
            torch.randn(24, 2, generator=g, dtype=torch.float64) @ torch.randn(2, 32, generator=g, dtype=torch.float64)
            for _ in range(4)
        ]
    )
    out = merge([low.to(dtype)], method)[0].double()
    ref = merge_ref(low.to(dtype), method)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= merge_tol(method, dtype, gap_cond(low, method)), rel_err(out, ref)
    zero = torch.zeros(4, 6, 5, dtype=dtype)  # zero in, zero out (never NaN)
    assert torch.equal(merge([zero], method)[0], torch.zeros(6, 5, dtype=dtype))


def test_captured_pseudo_gradients_as_workers():
    """Workers built from real pseudo-gradients (a shared part plus each worker's own window)."""
    mats = [d for _, d in captured_pseudo_gradients() if d.ndim == 2 and min(d.shape) >= 8][:3]
    for d in mats:
        d = d.float()
        m, n = d.shape
        hm, hn = m // 2, n // 2
        parts = [d[:hm, :hn], d[hm : 2 * hm, :hn], d[:hm, hn : 2 * hn], d[hm : 2 * hm, hn : 2 * hn]]
        x = torch.stack([parts[0] + p for p in parts[1:]])
        for method in MERGES:
            check(x, method)


def test_batched_mixed_and_non_contiguous_stacks_match_one_by_one():
    g = gen("batched")
    stacks = [
        torch.randn(4, 16, 12, generator=g),
        torch.randn(4, 12, 16, generator=g).mT,  # non-contiguous [K, 16, 12]
        torch.randn(4, 16, 12, generator=g, dtype=torch.float64),
        torch.randn(4, 7, generator=g),
        torch.randn(4, 16, 12, generator=g),
    ]
    for method in MERGES:
        together = merge(stacks, method)
        for j, s in enumerate(stacks):
            alone = merge([s], method, stack_ids=[j])[0]
            assert torch.allclose(together[j], alone, rtol=1e-6, atol=1e-7), (method, j)


@pytest.mark.parametrize("method", list(MERGES))
def test_merge_in_place_writes_slot_zero_only(method):
    x = torch.randn(4, 8, 6, generator=gen("inplace"))
    before = x.clone()
    ref = merge([x], method)[0]
    (slot,) = merge_([x], method)
    assert slot.data_ptr() == x.data_ptr()
    assert torch.equal(x[0], ref) and torch.equal(x[1:], before[1:])


# -- the failure contract -------------------------------------------------------------------------


def test_bad_input_is_refused_by_name_and_nothing_changes():
    g = gen("bad")
    good = torch.randn(4, 6, 5, generator=g)
    nan = torch.randn(4, 6, 5, generator=g)
    nan[2, 3, 1] = float("nan")
    copies = [good.clone(), nan.clone()]
    with pytest.raises(ValueError, match=r"stack 1 .*worker 2.*NaN"):
        merge_([good, nan], "tsv")
    assert torch.equal(good, copies[0]) and torch.equal(nan.nan_to_num(), copies[1].nan_to_num())
    with pytest.raises(ValueError, match="stack 1 has 3 workers, stack 0 has 4"):
        merge_([good, torch.randn(3, 6, 5)], "mean")
    with pytest.raises(ValueError, match="K = 0"):  # K = 1 is a merge (tests/merges/test_merge_contracts.py)
        merge([torch.randn(0, 6, 5)], "iso_c")
    with pytest.raises(ValueError, match=r"stack 0: expected \[K, \*shape\]"):
        merge([torch.tensor(1.0)], "mean")
    with pytest.raises(ValueError, match="merge must be one of"):
        merge([good], "task_arithmetic")
    with pytest.raises(TypeError, match="unknown option"):
        merge([good], "tsv", sparsity=0.5)
    with pytest.raises(ValueError, match=r"sparsity must be in \[0, 1\)"):
        merge([good], "dare", sparsity=1.0)
    with pytest.raises(TypeError, match="dtype torch.int64"):
        merge([torch.ones(2, 3, 3, dtype=torch.int64)], "mean")
    assert torch.equal(good, copies[0])


def test_overflow_is_refused_with_nothing_written():
    big = torch.full((2, 4, 4), 3.0e38)  # DARE's 1/(1 − p) pushes the mean past float32's max
    small = torch.randn(2, 4, 4, generator=gen("ovf"))
    before = small.clone()
    with pytest.raises(ResultOverflowError, match="stack 1"):
        merge_([small, big], "dare", sparsity=0.5, seed=3)
    assert torch.equal(small, before)


# -- DARE's random stream -------------------------------------------------------------------------


def test_dare_hash_on_tensors_is_the_reference_bit_for_bit():
    v = torch.tensor([0, 1, 2, 12345, 2**31 - 1, 2**31, 2**32 - 1], dtype=torch.int64)
    assert mix32_tensor(v).tolist() == [mix32(int(i)) for i in v]
    key = stream_key(7, 3, 2)
    idx = torch.arange(5000, dtype=torch.int64)
    assert mix32_tensor(idx ^ key).tolist() == [mix32(key ^ i) for i in range(5000)]


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dare_drops_at_its_rate_independently_per_worker_and_seed(p):
    n = 20000
    masks = [keep_mask((n,), p, seed, 0, k) for seed in (0, 1) for k in range(2)]
    for m in masks:  # binomial: 5 standard deviations
        assert abs(m.float().mean().item() - (1 - p)) <= 5 * (p * (1 - p) / n) ** 0.5
    agree = (masks[0] == masks[1]).float().mean().item()  # independent → p² + (1 − p)²
    assert abs(agree - (p * p + (1 - p) ** 2)) <= 5 * (0.25 / n) ** 0.5
    assert not torch.equal(masks[0], masks[2])  # a new seed draws new drops


# -- the official code's outputs --------------------------------------------------------------------

_OURS = {  # fixture method → (our merge, its options) where parameterised alike
    "iso_c": ("iso_c", {}),
    "iso_cts": ("iso_cts", {}),
    "ties": ("ties", {"sparsity": 0.1}),
    "ties_keep20": ("ties", {"sparsity": 0.8}),
    "ties_no_trim": ("ties", {"sparsity": 0.0}),
    "mergeloco_defaults": ("mean", {}),
}


def _cases():
    return torch.load(FIXTURE)["cases"]


def test_fixture_is_the_documented_one():
    f = torch.load(FIXTURE)
    assert f["meta"]["commit"] == "75dc7a1a9a39f88384e915c8e72f336b28d82c31"
    assert len(f["cases"]) == 226
    assert (Path(__file__).parents[1] / "data" / "merges_official.md").exists()


def test_equal_to_the_official_code_where_parameterised_alike():
    seen = set()
    for c in _cases():
        x, off = c["inputs"], c["out"]
        K = x.shape[0]
        if c["method"] in _OURS and c["unique"]:
            name, opts = _OURS[c["method"]]
            got = merge([x], name, **opts)[0]
            assert rel_err(got, off) <= 1e-10, (c["id"], rel_err(got, off))
        elif c["method"] == "tsv" and c["unique"]:
            # ours is at the mean's scale (Δ_i / K), the official TSVLoCo at the sum's: × K
            # (1-D tensors: the mean in both)
            scale = K if x.ndim == 3 else 1
            assert rel_err(merge([x], "tsv")[0] * scale, off) <= 1e-10, c["id"]
        elif c["method"] == "iso_c" and not c["unique"]:
            # rank-deficient mean: the official output pairs null spaces arbitrarily; its projection
            # on the mean's column space is unique and equals ours (which is zero outside it)
            u, s, _ = torch.linalg.svd(x.mean(0), full_matrices=False)
            ur = u[:, s > 1e-10 * s[0]]
            assert rel_err(merge([x], "iso_c")[0], ur @ (ur.mT @ off)) <= 1e-10, c["id"]
        elif c.get("masks") is not None:  # DARE & random drops: their masks through our combine rule
            p = c["params"]["sparsity"]
            got = sparse_ref(x, sparsity=p, prune="random", rescale=c["params"]["rescale_pruned"], masks=c["masks"])
            assert rel_err(got, off) <= 1e-14, c["id"]
        elif c["method"] == "prune_magnitude_row":
            got = sparse_ref(x, sparsity=0.5, prune="magnitude", dim="row")
            assert rel_err(got, off) <= 1e-14, c["id"]
        else:
            continue
        seen.add(c["method"])
    assert seen >= {"iso_c", "iso_cts", "tsv", "ties", "dare", "ties_keep20", "dare_p05", "prune_magnitude_row"}
