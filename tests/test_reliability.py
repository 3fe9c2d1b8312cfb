"""The library's promises under bad input, on one process: a clear error naming what is wrong and
nothing modified, or the right finite result; never NaN/Inf written silently, never a partial write.

The multi-rank versions live in test_distributed.py.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import isoloco_kernels as ik
from isoloco_kernels.reference import iso_flatten_ref, isoloco_step_ref
from tests.helpers import TOL, rel_err

EXACT = ("svd", "eigh")
ALL = ("svd", "eigh", "polar")

# A 4×4 whose Iso-C result is ~1.5× its largest entry (found by a small search): scaled near a
# half dtype's max it has a result that does not fit the dtype.
GROWS = torch.tensor([[-1, 1, 1, 1], [-1, 1, 0.4, 0.4], [-0.8, 1, 1, -1], [-0.5, 1, -1, 1]], dtype=torch.float64)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------------------------
# Overflow: Iso-C is positively homogeneous, so every finite input with a representable result
# gets it


def _homogeneous(x, method, shift):
    """iso(x) computed at a harmless scale 2^-shift, scaled back (exact: powers of two)."""
    return ik.iso_flatten(x * 2.0**-shift, method=method) * 2.0**shift


@pytest.mark.parametrize("method", ALL)
def test_huge_square_input_gives_the_right_finite_result(method):
    # The svd path `auto` picks for a square CPU matrix returned all NaN here.
    x = torch.ones(128, 128) * 1e37 + torch.eye(128) * 1e36
    want = _homogeneous(x, method, 120)
    ik.iso_merge_([x], method=method)
    assert torch.isfinite(x).all()
    assert torch.equal(x, want)  # Iso-C is homogeneous: the same digits as at scale 1
    # vs float64: the exact methods compute in float64, so the float32 rounding of the result bounds
    # them (svd's row; measured 4.9e-9: the result is a multiple of I). A float32 SVD of this matrix
    # (σ: 1.29e38 once, 1e36 127 times) is off by ~2e-4 at any scale; eigh's Gram matrix adds
    # only eps64·κ² ≈ 4e-10 at κ 1.3e3.
    tol = TOL[("polar" if method == "polar" else "svd", torch.float32)]
    ref = iso_flatten_ref(torch.ones(128, 128, dtype=torch.float64) * 10 + torch.eye(128, dtype=torch.float64))
    assert rel_err(x, ref * 1e36) < tol


@pytest.mark.parametrize("method", ALL)
def test_huge_wide_input_gives_the_right_finite_result(method):
    # eigh returned Inf here (the Gram matrix overflows), polar raised.
    x = torch.randn(3, 24, 96, generator=_gen(1)) * 3e37
    want = _homogeneous(x, method, 120)
    ref = iso_flatten_ref(x.double() / 1e37) * 1e37
    ik.iso_merge_([x], method=method)
    assert torch.isfinite(x).all() and torch.equal(x, want)
    # the exact methods: the float32 rounding of the result (svd's row; measured 2.6e-8, κ ~3)
    assert rel_err(x, ref) < TOL[("polar" if method == "polar" else "svd", torch.float32)]


@pytest.mark.parametrize("method", EXACT)
def test_tiny_input_keeps_its_directions(method):
    x = torch.randn(16, 40, generator=_gen(2), dtype=torch.float64) * 1e-300
    ref = iso_flatten_ref(x * 1e300) * 1e-300
    ik.iso_merge_([x], method=method)
    assert rel_err(x, ref) < TOL[("exact", torch.float64)]


@pytest.mark.parametrize("dtype,scale", [(torch.float16, 6e4), (torch.bfloat16, 2.5e38)])
@pytest.mark.parametrize("method", ALL)
def test_half_result_that_does_not_fit_raises_naming_bucket_and_matrix(dtype, scale, method):
    ok = torch.randn(2, 4, 4, generator=_gen(3)).to(dtype)
    bad = torch.stack([torch.rand(4, 4, generator=_gen(4)) - 0.5, GROWS.float()]).mul(scale).to(dtype)
    assert torch.isfinite(bad).all()
    before = [ok.clone(), bad.clone()]
    with pytest.raises(ValueError, match=r"bucket 1.*matrix 1.*(fit|overflow)"):
        ik.iso_merge_([ok, bad], method=method)
    assert torch.equal(ok, before[0]) and torch.equal(bad, before[1])


def test_half_input_near_max_with_a_result_that_fits():
    x = (torch.randn(8, 8, generator=_gen(5)).abs() * 6e4).clamp_max(6e4).to(torch.float16)
    ref = iso_flatten_ref(x.double())
    assert ref.abs().max() < 65504
    ik.iso_merge_([x], method="svd")
    assert torch.isfinite(x).all() and rel_err(x, ref) < TOL[("exact", torch.float16)]


def test_isoloco_huge_grad_right_result_or_clear_error():
    # auto picks svd for a square 128×128 on the CPU, which turned every param NaN here
    ps = [torch.randn(128, 128, generator=_gen(6)), torch.randn(32, generator=_gen(7))]
    grads = [torch.ones(128, 128) * 1e37 + torch.eye(128) * 1e36, torch.randn(32, generator=_gen(9)) * 1e37]
    opt = ik.IsoLoCo(ps, lr=1.8, momentum=0.8)
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    ref_p, _ = isoloco_step_ref(ps, [torch.zeros_like(p) for p in ps], grads, 1.8, 0.8)
    opt.step()
    for p, r in zip(ps, ref_p):
        assert torch.isfinite(p).all()
        # float64 svd, then the float32 update (measured ≤ 5e-8); a float32 svd would be ~2e-4 off
        assert rel_err(p, r) < TOL[("update", torch.float32)]


def test_isoloco_update_that_overflows_is_refused_with_nothing_changed():
    ps = [torch.randn(8, 8, generator=_gen(10)), torch.randn(8, generator=_gen(11))]
    opt = ik.IsoLoCo(ps, lr=1.8, momentum=0.8)
    ps[0].grad = torch.randn(8, 8, generator=_gen(12))
    ps[1].grad = torch.full((8,), 3e38)  # lr·(1 + μ)·g overflows float32
    before = [p.clone() for p in ps]
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\].*(overflow|not finite)"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(ps, before))
    assert len(opt.state) == 0


# ----------------------------------------------------------------------------------------------
# Partial writes: every tensor that will be written is checked before anything is written


def _merge_refused(bad, match, exc=(ValueError, RuntimeError, TypeError)):
    a = torch.randn(4, 6, generator=_gen(20))
    before = a.clone()
    with pytest.raises(exc, match=match):
        ik.iso_merge_([a, bad])
    assert torch.equal(a, before)


def test_iso_merge_refuses_an_expanded_bucket_before_writing():
    _merge_refused(torch.randn(1, 6, generator=_gen(21)).expand(4, 6), r"bucket 1.*overlap")


def test_iso_merge_refuses_a_leaf_that_requires_grad():
    _merge_refused(torch.randn(4, 6, generator=_gen(22)).requires_grad_(), r"bucket 1.*requires grad")


def test_iso_merge_refuses_an_inference_tensor():
    with torch.inference_mode():
        t = torch.randn(4, 6, generator=_gen(23))
    _merge_refused(t, r"bucket 1.*inference")


def test_iso_merge_refuses_a_meta_tensor():
    _merge_refused(torch.empty(4, 6, device="meta"), r"bucket 1.*meta")


def test_iso_merge_refuses_buckets_that_share_memory():
    base = torch.randn(8, 6, generator=_gen(24))
    before = base.clone()
    with pytest.raises(RuntimeError, match=r"bucket 0.*bucket 1.*overlap|bucket 1.*bucket 0.*overlap"):
        ik.iso_merge_([base[:5], base[3:]])
    assert torch.equal(base, before)


def test_iso_merge_accepts_disjoint_views_of_one_storage():
    base = torch.randn(8, 6, generator=_gen(25), dtype=torch.float64)
    ref = [iso_flatten_ref(base[:4]), iso_flatten_ref(base[4:])]
    ik.iso_merge_([base[:4], base[4:]])
    assert rel_err(base[:4], ref[0]) < TOL[("exact", torch.float64)]
    assert rel_err(base[4:], ref[1]) < TOL[("exact", torch.float64)]


def test_nesterov_refuses_an_expanded_param_before_writing():
    g = _gen(26)
    p0, b0, u0 = (torch.randn(6, generator=g) for _ in range(3))
    p1 = torch.randn(1, generator=g).expand(6)
    b1, u1 = torch.randn(6, generator=g), torch.randn(6, generator=g)
    before = p0.clone(), b0.clone()
    with pytest.raises(RuntimeError, match=r"param 1.*overlap"):
        torch.ops.isoloco.nesterov_outer_([p0, p1], [b0, b1], [u0, u1], 0.5, 0.9, None)
    assert torch.equal(p0, before[0]) and torch.equal(b0, before[1])


def test_nesterov_refuses_a_buffer_shared_by_two_params():
    g = _gen(27)
    ps = [torch.randn(6, generator=g) for _ in range(2)]
    buf = torch.randn(6, generator=g)
    us = [torch.randn(6, generator=g) for _ in range(2)]
    before = [p.clone() for p in ps], buf.clone()
    with pytest.raises(RuntimeError, match=r"buf 1.*buf 0.*overlap|buf 0.*buf 1.*overlap"):
        torch.ops.isoloco.nesterov_outer_(ps, [buf, buf], us, 0.5, 0.9, None)
    assert all(torch.equal(p, b) for p, b in zip(ps, before[0])) and torch.equal(buf, before[1])


def test_nesterov_refuses_infinite_lr_and_momentum():
    p, b, u = torch.zeros(3), torch.zeros(3), torch.ones(3)
    for lr, mu in ((float("inf"), 0.9), (0.5, float("inf")), (float("-inf"), 0.9)):
        with pytest.raises(ValueError, match="lr|momentum"):
            torch.ops.isoloco.nesterov_outer_([p], [b], [u], lr, mu, None)
    assert not p.any() and not b.any()


def test_nesterov_refuses_an_inference_tensor():
    with torch.inference_mode():
        p = torch.zeros(3)
    b0, p0 = torch.zeros(3), torch.zeros(3)
    with pytest.raises(RuntimeError, match=r"param 1.*inference"):
        torch.ops.isoloco.nesterov_outer_([p0, p], [b0, torch.zeros(3)], [torch.ones(3)] * 2, 0.5, 0.9, None)
    assert not p0.any() and not b0.any()


def _opt_with_state(seed=30):
    g = _gen(seed)
    ps = [torch.randn(6, 4, generator=g), torch.randn(4, 6, generator=g), torch.randn(5, generator=g)]
    opt = ik.IsoLoCo(ps, lr=0.5, momentum=0.9)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    return ps, opt


def _snapshot(ps, opt):
    return [p.clone() for p in ps], {id(p): s["momentum_buffer"].clone() for p, s in opt.state.items()}


def _unchanged(ps, opt, snap):
    return all(torch.equal(p, q) for p, q in zip(ps, snap[0])) and all(
        torch.equal(s["momentum_buffer"], snap[1][id(p)]) for p, s in opt.state.items()
    )


def test_isoloco_refuses_an_expanded_momentum_buffer_from_a_state_dict():
    ps, opt = _opt_with_state()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][2]["momentum_buffer"] = torch.randn(1).expand(5)
    snap = _snapshot(ps, opt)
    with pytest.raises((ValueError, RuntimeError), match=r"momentum_buffer.*overlap|overlap.*momentum_buffer"):
        opt.load_state_dict(sd)
        opt.step()
    assert _unchanged(ps, opt, snap)


def test_isoloco_refuses_params_that_share_memory():
    base = torch.randn(10, 4)
    before = base.clone()
    opt = ik.IsoLoCo([base[:6], base[4:]], lr=0.5, momentum=0.9)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.randn(p.shape)
    with pytest.raises(RuntimeError, match=r"overlap"):
        opt.step()
    assert torch.equal(base, before)


def test_isoloco_refuses_an_inference_param():
    with torch.inference_mode():
        p = torch.randn(4, 4)
    q = torch.randn(4, 4)
    opt = ik.IsoLoCo([q, p], lr=0.5, momentum=0.9)
    q.grad, p.grad = torch.randn(4, 4), torch.randn(4, 4)
    before = q.clone()
    with pytest.raises(RuntimeError, match=r"\[1\].*inference"):
        opt.step()
    assert torch.equal(q, before) and len(opt.state) == 0


# ----------------------------------------------------------------------------------------------
# Optimizer objects: copies and state dicts


def test_isoloco_deepcopy_and_pickle_step_like_the_original():
    ps, opt = _opt_with_state(40)
    opt.method = "svd"
    clones = [copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))]
    assert all(c.method == "svd" for c in clones)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=_gen(41))
    results = []
    for c in clones:
        cp = [q for g in c.param_groups for q in g["params"]]
        for q, p in zip(cp, ps):
            q.grad = p.grad.clone()
        c.step()
        results.append(cp)
    opt.step()
    for cp in results:
        for q, p in zip(cp, ps):
            assert torch.equal(q, p)


def test_isoloco_pickled_with_a_process_group_says_so_when_stepped():
    ps, opt = _opt_with_state(42)
    opt.process_group = object()  # stands in for a group: not picklable, must not travel
    clone = pickle.loads(pickle.dumps(opt))
    assert clone.process_group is None
    cp = clone.param_groups[0]["params"]
    for q in cp:
        q.grad = torch.randn(q.shape)
    with pytest.raises(RuntimeError, match="process_group"):
        clone.step()
    clone.process_group = None
    clone.step()  # usable again once the caller says there is no group


@pytest.mark.parametrize(
    "edit,match",
    [
        pytest.param(lambda sd: sd.pop("state"), r"'state'", id="no-state"),
        pytest.param(lambda sd: sd.pop("param_groups"), r"'param_groups'", id="no-param-groups"),
        pytest.param(lambda sd: sd["param_groups"][0].pop("lr"), r"param group 0.*'lr'", id="no-lr"),
        pytest.param(lambda sd: sd["param_groups"][0].update(lr="0.5"), r"param group 0.*lr", id="lr-str"),
        pytest.param(
            lambda sd: sd["param_groups"][0].update(momentum="x"), r"param group 0.*momentum", id="momentum-str"
        ),
        pytest.param(lambda sd: sd["param_groups"][0].update(lr=float("inf")), r"param group 0.*lr", id="lr-inf"),
        pytest.param(
            lambda sd: sd["state"][0].update(momentum_buffer="zeros"), r"param 0.*momentum_buffer", id="buffer-str"
        ),
        pytest.param(
            lambda sd: sd["state"][0].update(momentum_buffer=torch.zeros(3)),
            r"param 0.*momentum_buffer",
            id="buffer-shape",
        ),
        pytest.param(
            lambda sd: sd["state"][1].update(momentum_buffer=torch.full((4, 6), float("nan"))),
            r"momentum_buffer",
            id="buffer-nan",
        ),
    ],
)
def test_load_state_dict_refuses_bad_fields_at_load_with_nothing_changed(edit, match):
    ps, opt = _opt_with_state(50)
    sd = copy.deepcopy(opt.state_dict())
    edit(sd)
    snap = _snapshot(ps, opt)
    groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    with pytest.raises((ValueError, TypeError), match=match):
        opt.load_state_dict(sd)
    assert _unchanged(ps, opt, snap)
    assert groups == [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    opt.step()  # still usable
