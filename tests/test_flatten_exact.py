"""The exact backends (svd, eigh) and the op/API contract, on CPU, against reference.py."""
from __future__ import annotations

import zlib

import pytest
import torch

import isoloco_kernels as ik
from isoloco_kernels.reference import iso_flatten_ref
from tests.helpers import DTYPES, TOL, rel_err

SHAPES = [(7, 7), (13, 5), (5, 13), (1, 9), (9, 1), (3, 6, 4), (4, 5, 17), (2, 33, 8)]
EXACT = ("svd", "eigh", "auto")


def _rand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("method", EXACT)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference(method, dtype, shape):
    x = _rand(shape, dtype, seed=zlib.crc32(repr((shape, str(dtype))).encode()))
    ref = iso_flatten_ref(x)
    out = ik.iso_flatten(x, method=method)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, ref) <= TOL[("exact", dtype)]


@pytest.mark.parametrize("method", EXACT)
def test_in_place_on_non_contiguous_views(method):
    base = _rand((3, 12, 20), torch.float32, seed=1)
    view = base.transpose(-1, -2)  # [3, 20, 12], non-contiguous
    ref = iso_flatten_ref(view)
    ptr = base.data_ptr()
    out = ik.iso_merge_([view], method=method)
    assert out[0] is view and base.data_ptr() == ptr
    assert rel_err(view, ref) <= TOL[("exact", torch.float32)]
    strided = _rand((10, 16), torch.float64, seed=2)[::2, 1::3]
    ref2 = iso_flatten_ref(strided)
    ik.iso_merge_([strided], method=method)
    assert rel_err(strided, ref2) <= TOL[("exact", torch.float64)]


def test_full_rank_equals_published_formula():
    x = _rand((4, 9, 14), torch.float64, seed=3)
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    published = u @ torch.diag_embed(s.mean(-1, keepdim=True).expand_as(s)) @ vh
    assert rel_err(iso_flatten_ref(x), published) <= 1e-12  # one LAPACK SVD of a cond ~10 matrix, two products
    for method in EXACT:
        assert rel_err(ik.iso_flatten(x, method=method), published) <= TOL[("exact", torch.float64)]


@pytest.mark.parametrize("method", EXACT)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=str)
def test_rank_deficient_zero_in_zero_out(method, dtype):
    x = _rand((3, 10, 8), dtype, seed=4)
    x[0, 2] = 0  # zero row
    x[1, :, 5] = 0  # zero column
    x[2] = 0  # zero matrix
    out = ik.iso_flatten(x, method=method)
    assert torch.isfinite(out).all()
    assert (out[0, 2] == 0).all() and (out[1, :, 5] == 0).all() and (out[2] == 0).all()
    assert rel_err(out, iso_flatten_ref(x)) <= TOL[("exact", dtype)] * 10
    # rank one: iso(a bᵀ) = (σ / r0) · â b̂ᵀ
    a, b = _rand((10,), dtype, 5), _rand((8,), dtype, 6)
    r1 = torch.outer(a, b)
    expect = (a.norm() * b.norm() / 8) * torch.outer(a / a.norm(), b / b.norm())
    assert rel_err(ik.iso_flatten(r1, method=method), expect) <= TOL[("exact", dtype)] * 10


def _set(i, value):
    def edit(buckets):
        buckets[i] = value
    return edit


def _poke(i, index, value):
    def edit(buckets):
        buckets[i][index] = value
    return edit


@pytest.mark.parametrize(
    "edit,method,match",
    [
        pytest.param(_poke(1, (2, 1, 3), float("nan")), "svd", r"bucket 1: matrix 2 contains NaN", id="nan"),
        pytest.param(_poke(2, (0, 0), float("-inf")), "svd", r"bucket 2: the matrix contains Inf", id="inf"),
        pytest.param(_set(2, torch.ones(3, 3, dtype=torch.int64)), "svd", r"bucket 2: dtype torch.int64", id="int"),
        pytest.param(_set(1, torch.randn(5)), "svd", r"bucket 1: expected a \[m, n\] matrix", id="ndim1"),
        pytest.param(_set(1, torch.randn(2, 2, 3, 3)), "svd", r"bucket 1: expected", id="ndim4"),
        pytest.param(_set(0, [[1.0, 2.0]]), "svd", r"bucket 0: expected a torch.Tensor", id="not-tensor"),
        pytest.param(lambda buckets: None, "qr", r"method must be one of", id="method"),
    ],
)
def test_bad_input_names_the_bucket_and_changes_nothing(edit, method, match):
    buckets = [_rand((5, 6), torch.float32, 7), _rand((3, 4, 4), torch.float32, 8), _rand((2, 3), torch.float64, 9)]
    edit(buckets)
    before = [b.clone() if isinstance(b, torch.Tensor) else b for b in buckets]
    with pytest.raises((ValueError, TypeError), match=match):
        ik.iso_merge_(buckets, method=method)
    for b, b0 in zip(buckets, before):
        if isinstance(b, torch.Tensor):
            assert torch.equal(b.view(torch.uint8), b0.view(torch.uint8))  # bit-identical, NaN included


@pytest.mark.parametrize("method", ["svd", "eigh", "polar", "polar_bf16", "auto"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_op_level_nonfinite_leaves_input_untouched(method, value):
    x = _rand((4, 6, 6), torch.float32, 10)
    x[3, 0, 0] = float(value)
    before = x.clone()
    with pytest.raises(ValueError, match="matrix 3 (contains|gave a non-finite)"):
        torch.ops.isoloco.iso_flatten_(x, method)
    assert torch.equal(x.view(torch.int32), before.view(torch.int32))


def test_empty_and_zero_size():
    assert ik.iso_merge_([]) == []
    z = torch.empty(0, 4, 5)
    z2 = torch.empty(3, 0)
    out = ik.iso_merge_([z, z2])
    assert out[0] is z and out[1] is z2


def test_opcheck_iso_flatten():
    for method in ("svd", "eigh"):
        torch.library.opcheck(torch.ops.isoloco.iso_flatten_, (_rand((2, 5, 3), torch.float32, 11), method))
        torch.library.opcheck(torch.ops.isoloco.iso_flatten_, (_rand((6, 4), torch.float64, 12), method))


def test_opcheck_iso_scale_and_matches_reference():
    x = _rand((3, 5, 9), torch.float32, 13)
    torch.library.opcheck(torch.ops.isoloco.iso_scale_, (x.clone(), _rand((3, 5, 9), torch.float32, 14)))
    from isoloco_kernels.reference import polar_ref

    q, _ = polar_ref(x)
    y = x.clone()
    sbar = torch.ops.isoloco.iso_scale_(y, q.float())
    assert sbar.shape == (3,) and sbar.dtype == torch.float32
    assert rel_err(y, iso_flatten_ref(x)) <= TOL[("exact", torch.float32)]


def test_torch_compile_of_a_function_calling_iso_merge_():
    def outer(bs):
        ik.iso_merge_(bs, method="svd")
        return [b * 2 for b in bs]

    xs = [_rand((3, 7, 5), torch.float32, 15), _rand((4, 4), torch.float32, 16)]
    eager = outer([x.clone() for x in xs])
    compiled = torch.compile(outer)([x.clone() for x in xs])
    for a, b in zip(eager, compiled):
        assert rel_err(b, a) <= 1e-6


def test_op_compiles_fullgraph():
    def f(x):
        torch.ops.isoloco.iso_flatten_(x, "svd")
        return x.sum()

    x = _rand((2, 6, 4), torch.float32, 17)
    got = torch.compile(f, fullgraph=True)(x.clone())
    want = iso_flatten_ref(x).sum()
    assert abs(got.item() - want.item()) <= 1e-4 * (1 + abs(want.item()))


@pytest.mark.parametrize("method", ["svd", "eigh"])
def test_tall_well_conditioned_keeps_every_direction(method):
    """A cut at max(m, n)·eps32·σ_1 (2.4e-4 here) would drop the smallest directions of this
    cond-1e4 matrix and miss the reference by ~1e-2; the exact methods keep all of them."""
    from tests.helpers import spectrum, with_spectrum

    g = torch.Generator().manual_seed(21)
    x = with_spectrum(2, 2048, 32, spectrum("geometric", 32, cond=1e4), g).float()
    out = ik.iso_flatten(x, method=method)
    assert rel_err(out, iso_flatten_ref(x)) <= 1e-3  # fp32 SVD at cond 1e4: eps·cond-limited


def test_auto_is_exact_for_ill_conditioned_float64():
    """The Gram matrix squares cond, so auto must not pick eigh for float64 input (cond 1e6 here)."""
    from tests.helpers import spectrum, with_spectrum

    x = with_spectrum(3, 32, 48, spectrum("geometric", 32, cond=1e6), torch.Generator().manual_seed(22))
    ref = iso_flatten_ref(x)
    for method in ("auto", "svd"):
        assert rel_err(ik.iso_flatten(x, method=method), ref) <= TOL[("exact", torch.float64)], method
