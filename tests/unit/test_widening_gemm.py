"""widening_gemm: float32 arithmetic on packed bfloat16 weights, checked against float64 matmuls."""

from __future__ import annotations

import pytest
import torch

from cluster.kernels.build import widening_gemm

kernel = widening_gemm()
pytestmark = pytest.mark.skipif(kernel is None, reason="widening_gemm needs AVX-512 and a compiler")


def _bound(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """float32 summation error over K terms plus one rounding of the output to its dtype."""
    magnitude = x.double().abs() @ weight.double().abs().T
    return magnitude * (x.shape[1] * torch.finfo(torch.float32).eps) + 2 * torch.finfo(out_dtype).eps * (
        magnitude + 1.0)


@pytest.mark.parametrize("out_features, in_features", [(32, 64), (200, 192), (49, 576), (1, 16), (960, 576)])
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 25, 64])
def test_every_row_and_output_matches_the_float64_product(out_features, in_features, rows):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    packed = kernel.pack(weight)
    assert packed.shape == ((out_features + 31) // 32, in_features, 32) and packed.dtype == torch.bfloat16
    expected = x.double() @ weight.double().T + bias.double()
    y = kernel.linear(x, packed, out_features, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
    assert ((y.double() - expected).abs() <= _bound(x, weight, torch.bfloat16)).all()
    y32 = kernel.linear(x.float(), packed, out_features, None)  # float32 in, float32 out, no bias
    assert y32.dtype == torch.float32
    assert ((y32.double() - (expected - bias.double())).abs() <= _bound(x, weight, torch.float32)).all()


def test_rounding_to_bfloat16_is_torchs_nearest_even_and_keeps_inf_and_nan():
    weight = torch.eye(32, dtype=torch.bfloat16)
    # float32 values between bfloat16 numbers (ties to even both ways), one that overflows bfloat16's
    # rounding to inf, and one past float32's range once doubled
    values = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -9, 1 + 2 ** -9, -(1 + 2 ** -9), 3.3e38, -2.0e38] + [0.0] * 26)
    x = values[None, :]  # float32 x: every product is exact (the weight is the identity)
    assert torch.equal(kernel.linear(x, kernel.pack(weight), 32, None), x)  # float32 out: not rounded
    assert torch.equal(kernel.linear(x.to(torch.bfloat16), kernel.pack(weight), 32, None),
                       x.to(torch.bfloat16))  # x rounded first: the identity keeps it
    doubled = kernel.linear(x, kernel.pack(2 * weight), 32, None)
    assert torch.equal(doubled, 2 * x) and doubled[0, 4] == float("inf") and doubled[0, 5] == float("-inf")
    # bfloat16 out: the float32 sum (a bfloat16 x plus the bias) rounded once, as torch rounds it
    with_bias = kernel.linear(x.to(torch.bfloat16), kernel.pack(weight), 32, torch.full((32,), 2 ** -9))
    assert torch.equal(with_bias, (x.to(torch.bfloat16).float() + 2 ** -9).to(torch.bfloat16))
    nan = kernel.linear(torch.full((1, 32), float("nan")).to(torch.bfloat16), kernel.pack(weight), 32, None)
    assert torch.isnan(nan.float()).all()


def test_bad_input_is_refused_with_what_was_wrong():
    packed = kernel.pack(torch.randn(40, 64).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernel.pack(torch.randn(40, 64))
    with pytest.raises(RuntimeError, match="features"):
        kernel.linear(torch.randn(3, 32).to(torch.bfloat16), packed, 40, None)
    with pytest.raises(RuntimeError, match="out_features"):
        kernel.linear(torch.randn(3, 64).to(torch.bfloat16), packed, 80, None)
    with pytest.raises(RuntimeError, match="bias"):
        kernel.linear(torch.randn(3, 64).to(torch.bfloat16), packed, 40, torch.zeros(39))
    assert kernel.linear(torch.randn(0, 64).to(torch.bfloat16), packed, 40, None).shape == (0, 40)
