"""The exact methods (svd, eigh), iso_scale_ and the op under torch.compile, on CPU, against
reference.py. The contract every method keeps (shapes, dtypes, views, zeros, bad input, opcheck)
is tests/flatten/test_methods.py."""

from __future__ import annotations

import pytest
import torch

import isoloco_kernels as ik
from isoloco_kernels.flatten import exact
from isoloco_kernels.reference import iso_flatten_ref
from tests.helpers import TOL, method_tol, rel_err, spectrum, with_spectrum


def _rand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def test_opcheck_iso_scale_and_matches_reference():
    x = _rand((3, 5, 9), torch.float32, 13)
    torch.library.opcheck(torch.ops.isoloco.iso_scale_, (x.clone(), _rand((3, 5, 9), torch.float32, 14)))
    from isoloco_kernels.reference import polar_ref

    q, _ = polar_ref(x)
    y = x.clone()
    sbar = torch.ops.isoloco.iso_scale_(y, q.float())
    assert sbar.shape == (3,) and sbar.dtype == torch.float32
    assert rel_err(y, iso_flatten_ref(x)) <= TOL[("iso_scale", torch.float32)]  # Q exact: measured 1.1e-7


def test_torch_compile_of_a_function_calling_iso_merge_():
    def outer(bs):
        ik.iso_merge_(bs, method="svd")
        return [b * 2 for b in bs]

    xs = [_rand((3, 7, 5), torch.float32, 15), _rand((4, 4), torch.float32, 16)]
    eager = outer([x.clone() for x in xs])
    compiled = torch.compile(outer)([x.clone() for x in xs])
    for a, b, x in zip(eager, compiled, xs):
        assert torch.equal(b, a)  # the same kernels, the same digits
        assert rel_err(b, 2 * iso_flatten_ref(x)) <= TOL[("svd", torch.float32)]


def test_op_compiles_fullgraph():
    def f(x):
        torch.ops.isoloco.iso_flatten_(x, "svd")
        return x * 2

    x = _rand((2, 6, 4), torch.float32, 17)
    y = x.clone()
    got = torch.compile(f, fullgraph=True)(y)
    eager = x.clone()
    torch.ops.isoloco.iso_flatten_(eager, "svd")
    assert torch.equal(y, eager)  # flattened in place, as eager does
    assert torch.equal(got, 2 * eager)
    assert rel_err(y, iso_flatten_ref(x)) <= TOL[("svd", torch.float32)]


@pytest.mark.parametrize("method", ["svd", "eigh"])
def test_tall_well_conditioned_keeps_every_direction(method):
    """A cut at max(m, n)·eps32·σ_1 (2.4e-4 here) would drop the smallest directions of this
    cond-1e4 matrix and miss the reference by ~1e-2; the exact methods keep all of them."""
    g = torch.Generator().manual_seed(21)
    x = with_spectrum(2, 2048, 32, spectrum("geometric", 32, cond=1e4), g).float()
    out = ik.iso_flatten(x, method=method)
    # each method's float32 row at κ 1e4 (measured 2.5e-8 for both: the result's rounding); an SVD
    # or Gram matrix in float32 would be eps32·κ-limited here (≥ 1e-4)
    assert rel_err(out, iso_flatten_ref(x)) <= method_tol(method, torch.float32, 1e4)


def test_auto_is_exact_for_ill_conditioned_float64():
    """The Gram matrix squares cond, so auto must not pick eigh for float64 input (cond 1e6 here)."""
    x = with_spectrum(3, 32, 48, spectrum("geometric", 32, cond=1e6), torch.Generator().manual_seed(22))
    ref = iso_flatten_ref(x)
    for method in ("auto", "svd"):
        assert rel_err(ik.iso_flatten(x, method=method), ref) <= TOL[("exact", torch.float64)], method


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.filterwarnings("ignore::isoloco_kernels.flatten.iteration_stats.FlattenFallbackWarning")
def test_eigh_hands_what_its_gram_matrix_cannot_resolve_to_svd():
    x = with_spectrum(2, 16, 48, spectrum("lowrank_noise", 16, 1e6), _gen(10)).float()
    out = x.clone()
    exact.flatten_eigh_(out)
    assert rel_err(out, iso_flatten_ref(x)) <= TOL[("exact", torch.float32)]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.filterwarnings("ignore::isoloco_kernels.flatten.iteration_stats.FlattenFallbackWarning")
def test_svd_is_float64_so_float32_input_is_exact_at_cond_1e4():
    # a float32 SVD misses this by 10× (~2e-4); float64 GEMMs are immune to TF32 settings too
    x = with_spectrum(1, 32, 64, spectrum("lowrank_noise", 32, 1e4), _gen(11))[0].float()
    assert rel_err(ik.iso_flatten(x, method="svd"), iso_flatten_ref(x)) <= TOL[("exact", torch.float32)]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.filterwarnings("ignore::isoloco_kernels.flatten.iteration_stats.FlattenFallbackWarning")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_svd_on_cuda_ignores_the_users_tf32_setting():
    x = with_spectrum(1, 64, 96, spectrum("geometric", 64, 1e3), _gen(12))[0].float()
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        out = ik.iso_flatten(x.cuda(), method="svd")
        assert torch.backends.cuda.matmul.allow_tf32  # the user's state is left alone
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    assert rel_err(out, iso_flatten_ref(x)) <= TOL[("exact", torch.float32)]
