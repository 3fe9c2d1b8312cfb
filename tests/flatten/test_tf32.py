"""3xTF32 (isoloco_kernels/flatten/tf32.py): the TF32 rounding, the split product's accuracy, and polar's
float32 contract with its GEMMs so (the mode "fp32" takes on CUDA devices with TF32 tensor cores),
all on the CPU through the emulation; on a GPU the same checks run on the tensor cores."""

from __future__ import annotations

import pytest
import torch

from isoloco_kernels.flatten import polar, tf32
from isoloco_kernels.reference import iso_flatten_ref
from tests.helpers import gen, method_tol, rel_err, reset_tf32, spectrum, with_spectrum

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _device(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device(device)


def test_round_tf32_keeps_ten_mantissa_bits_and_rounds_to_nearest():
    x = torch.randn(10_000, generator=gen("tf32-round")) * torch.logspace(-30, 30, 10_000)
    r = tf32.round_tf32(x)
    assert ((r.view(torch.int32) & ((1 << 13) - 1)) == 0).all()  # the 13 dropped bits are clear
    assert torch.equal(torch.sign(r), torch.sign(x))
    err = ((r.double() - x.double()).abs() / x.double().abs()).max()
    assert 2.0**-13 < err <= 2.0**-11  # nearest (half an ulp of 10 bits), not truncation-exact
    assert torch.equal(tf32.round_tf32(r), r)  # TF32 values are fixed points
    ulp = torch.tensor([1.0 + 2.0**-10, 1.0 + 2.0**-11 + 2.0**-20, 1.0 + 2.0**-11 - 2.0**-20])
    assert tf32.round_tf32(ulp).tolist() == [1.0 + 2.0**-10, 1.0 + 2.0**-10, 1.0]
    special = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, torch.finfo(torch.float32).max])
    out = tf32.round_tf32(special)
    assert out[:2].isinf().all() and out[2] == 0 and torch.isfinite(out[4])
    assert tf32.round_tf32(torch.tensor([float("nan")])).isnan().all()
    with pytest.raises(TypeError, match="expected float32"):
        tf32.round_tf32(x.double())


@pytest.mark.parametrize("device", DEVICES)
def test_split_product_is_float32_accurate_where_one_tf32_gemm_is_not(device):
    dev = _device(device)
    a = torch.randn(3, 96, 400, generator=gen("mm-a")).to(dev)
    b = torch.randn(3, 400, 80, generator=gen("mm-b")).to(dev)
    want = a.double() @ b.double()
    e3 = rel_err(tf32.mm_tf32x3(a, b), want)
    e1 = rel_err(tf32.mm_tf32(a, b), want)
    reset_tf32()
    e32 = rel_err(a @ b, want)
    assert e1 > 1e-4  # one TF32 GEMM: ~2^-11 per operand
    assert e3 <= 2e-6 and e3 <= 20 * max(e32, 1e-8)  # three: within a few ulps of float32
    with pytest.raises(TypeError, match="float32 operands"):
        tf32.mm_tf32x3(a.double(), b.double())


def test_tf32_switch_restores_every_setting():
    reset_tf32()
    before = (torch.get_float32_matmul_precision(), getattr(torch.backends.cuda.matmul, "fp32_precision", None))
    with tf32.tf32_matmul():
        assert torch.get_float32_matmul_precision() == "high"
    assert (torch.get_float32_matmul_precision(), getattr(torch.backends.cuda.matmul, "fp32_precision", None)) == before
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # the user's TF32 via the legacy flag
        torch.backends.cuda.matmul.allow_tf32 = True
        want = [torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision]
        with tf32.tf32_matmul():
            pass
        assert [torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision] == want
        reset_tf32()
    with polar.ieee_fp32_matmul():  # nested the way polar runs it: IEEE outside, TF32 for 3 GEMMs
        with tf32.tf32_matmul():
            pass
        assert torch.get_float32_matmul_precision() == "highest"
    assert (torch.get_float32_matmul_precision(), getattr(torch.backends.cuda.matmul, "fp32_precision", None)) == before


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,kappa", [("geometric", 1e2), ("geometric", 1e4), ("lowrank_noise", 1e4)])
def test_polar_keeps_its_float32_contract_on_3xtf32(kind, kappa, device):
    """polar's row (1e-3 to κ 1e4, residual-checked) with every GEMM in 3xTF32: measured 3e-6 to
    2e-4 on the CPU emulation, so the bound has ≥ 5× room; no matrix needs the fallback."""
    dev = _device(device)
    x = with_spectrum(2, 48, 140, spectrum(kind, 48, kappa), gen(("tf32x3", kind, kappa))).float().to(dev)
    y = x.clone()
    polar.reset_stats()
    polar.flatten_polar_(y, mode="tf32x3")
    assert polar.last_stats().last_recomputed == ()
    assert rel_err(y, iso_flatten_ref(x)) <= method_tol("polar", torch.float32)


def test_polar_fp32_mode_picks_3xtf32_only_on_tensor_core_gpus():
    assert polar.precise_mode(torch.zeros(2, 3)) == torch.float32
    assert polar.precise_mode(torch.zeros(2, 3, dtype=torch.float64)) == torch.float64
    assert polar.precise_mode(torch.zeros(2, 3, dtype=torch.bfloat16)) == torch.float32
    if torch.cuda.is_available():
        want = polar.TF32X3 if torch.cuda.get_device_capability()[0] >= 8 else torch.float32
        assert polar.precise_mode(torch.zeros(2, 3, device="cuda")) == want
    with pytest.raises(ValueError, match="mode must be one of"):
        polar.flatten_polar_(torch.randn(1, 3, 4), mode="tf32")
    with pytest.raises(ValueError, match="needs float32 compute"):
        polar.polar_factor(torch.randn(1, 3, 4, dtype=torch.float64), gemm_dtypes=(polar.TF32X3,) * polar.STEPS)


def test_symmetric_products_take_two_gemms_at_the_same_accuracy():
    """Tf32x3Steps.gram / square (X·Xᵀ and A² of a symmetric A) against float64 and against the
    general three-GEMM product: the same accuracy, symmetric to float32 rounding."""
    x = torch.randn(2, 48, 300, generator=gen("sym-x"))
    want = x.double() @ x.double().mT
    got = tf32.Tf32x3Steps.gram(x)
    assert rel_err(got, want) <= 2e-6 and rel_err(got, got.mT) <= 1e-6
    assert rel_err(got, want) <= 4 * max(rel_err(tf32.mm_tf32x3(x, x.mT), want), 1e-8)
    a = (want / want.norm(dim=(-2, -1), keepdim=True)).float()
    sq = tf32.Tf32x3Steps.square(a)
    assert rel_err(sq, a.double() @ a.double()) <= 2e-6 and rel_err(sq, sq.mT) <= 1e-6
