"""lowbit_gemm: int8 and 4-bit weight GEMMs for few rows, checked against float64 products of the
dequantized weights; the tile layouts; 4-bit quantization; the layers built on them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cluster.kernels.build import lowbit_gemm
from cluster.quant.int4_linear import Int4Linear, quantize_int4
from cluster.quant.int8_linear import Int8Linear
from cluster.quant.lowbit_pack import pack_int4, pack_int8, unpack_int4, unpack_int8

kernel = lowbit_gemm()
needs_kernel = pytest.mark.skipif(kernel is None, reason="lowbit_gemm needs AVX2/AVX-512 and a compiler")
SHAPES = [(4, 64), (7, 128), (200, 192), (49, 576), (961, 1536)]  # N not a multiple of 4 among them


def _bound(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """float32 summation over K terms (pairs of bfloat16 products and a group sum count twice) plus one
    rounding of the output to its dtype, per output: [rows, N]."""
    magnitude = x.double().abs() @ weight.double().abs().T
    return magnitude * (4 * x.shape[1] * torch.finfo(torch.float32).eps) + 2 * torch.finfo(out_dtype).eps * (
        magnitude + 1.0)


def _int4_case(out_features, in_features, seed, group_size=64):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.1
    q, scale, offset = quantize_int4(weight, group_size)
    codes, params = pack_int4(q, scale, offset)
    return weight, (q, scale, offset), codes, params


def test_int8_tiles_unpack_to_the_weight():
    weight = torch.randint(-127, 128, (10, 128), dtype=torch.int8)
    packed = pack_int8(weight)
    assert packed.shape == (3, 2, 4, 64)
    assert torch.equal(unpack_int8(packed, 10), weight)
    assert (packed[2, :, 2:] == 0).all()  # rows past N are zero
    with pytest.raises(ValueError, match="multiple of 64"):
        pack_int8(torch.zeros(4, 96, dtype=torch.int8))


def _dequantized(q, scale, offset, group_size=64):
    return (q.view(q.shape[0], -1, group_size).float() * scale[..., None] + offset[..., None]).view(q.shape)


def test_int4_range_quantization_is_within_half_a_step_and_unpacks_to_its_dequantized_weight():
    weight = torch.randn(9, 192, generator=torch.Generator().manual_seed(1)) * 0.1
    q, scale, offset = quantize_int4(weight, refits=0)  # the groups' ranges alone
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and scale.shape == (9, 3)
    assert torch.equal(scale, scale.half().float()) and torch.equal(offset, offset.half().float())
    # half a step, and the top of a range may round above the float16-rounded scale's reach (clamped)
    assert ((_dequantized(q, scale, offset) - weight).abs() <= scale.repeat_interleave(64, 1) * 0.51 + 1e-3).all()
    codes, params = pack_int4(q, scale, offset)
    assert torch.equal(unpack_int4(codes, params, 9, torch.float32), _dequantized(q, scale, offset))
    constant = quantize_int4(torch.full((1, 64), 0.25))
    assert int(constant[0].max()) == 0 and float(constant[1]) == 1.0 and float(constant[2]) == 0.25
    with pytest.raises(ValueError, match="do not divide"):
        quantize_int4(torch.zeros(4, 96))
    with pytest.raises(ValueError, match="multiples of 64"):
        pack_int4(*quantize_int4(torch.zeros(4, 96), group_size=32))


def test_int4_refits_never_raise_a_groups_squared_error_and_lower_the_total():
    weight = torch.randn(64, 576, generator=torch.Generator().manual_seed(2)) * 0.05
    errors = {}
    for refits in (0, 4):
        q, scale, offset = quantize_int4(weight, refits=refits)
        assert torch.equal(scale, scale.half().float()) and torch.equal(offset, offset.half().float())
        errors[refits] = (_dequantized(q, scale, offset) - weight).square().view(64, 9, 64).sum(-1)
    assert (errors[4] <= errors[0]).all()
    assert errors[4].sum() < 0.95 * errors[0].sum()


@needs_kernel
@pytest.mark.parametrize("out_features, in_features", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 16])
def test_int8_kernel_matches_the_float64_product(out_features, in_features, rows):
    generator = torch.Generator().manual_seed(rows * 100 + out_features)
    weight_int8 = torch.randint(-127, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
    scale = torch.rand(out_features, generator=generator) * 0.01
    bias = torch.randn(out_features, generator=generator)
    weight = weight_int8.double() * scale.double()[:, None]
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, in_features, generator=generator).to(dtype)
        y = kernel.linear_int8(x, pack_int8(weight_int8), scale, out_features, bias)
        assert y.dtype == dtype and y.shape == (rows, out_features)
        expected = x.double() @ weight.T + bias.double()
        assert ((y.double() - expected).abs() <= _bound(x, weight, dtype)).all()


@needs_kernel
@pytest.mark.parametrize("out_features, in_features", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 16])
def test_int4_kernel_matches_the_float64_product(out_features, in_features, rows):
    _, _, codes, params = _int4_case(out_features, in_features, seed=rows)
    weight = unpack_int4(codes, params, out_features, torch.float64)
    generator = torch.Generator().manual_seed(rows)
    bias = torch.randn(out_features, generator=generator)
    for dtype in (torch.float32, torch.bfloat16):  # the float32 FMA path and (AVX-512-BF16) the pair path
        x = torch.randn(rows, in_features, generator=generator).to(dtype)
        y = kernel.linear_int4(x, codes, params, out_features, bias)
        assert y.dtype == dtype and y.shape == (rows, out_features)
        expected = x.double() @ weight.T + bias.double()
        assert ((y.double() - expected).abs() <= _bound(x, weight, dtype)).all()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_whatever_else_shares_the_call(dtype):
    """What keeps a quantized target's verification rows equal to its decode rows."""
    generator = torch.Generator().manual_seed(3)
    weight_int8 = torch.randint(-127, 128, (49, 576), generator=generator, dtype=torch.int8)
    scale = torch.rand(49, generator=generator)
    _, _, codes, params = _int4_case(49, 576, seed=3)
    x = torch.randn(16, 576, generator=generator).to(dtype)
    for rows in range(1, 17):
        together8 = kernel.linear_int8(x[:rows], pack_int8(weight_int8), scale, 49, None)
        together4 = kernel.linear_int4(x[:rows], codes, params, 49, None)
        for i in (0, rows - 1):
            assert torch.equal(together8[i], kernel.linear_int8(x[i:i + 1], pack_int8(weight_int8), scale, 49, None)[0])
            assert torch.equal(together4[i], kernel.linear_int4(x[i:i + 1], codes, params, 49, None)[0])


@needs_kernel
def test_bad_calls_say_what_was_wrong():
    _, _, codes, params = _int4_case(8, 64, seed=0)
    packed = pack_int8(torch.zeros(8, 64, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="takes 1 to 16 rows, got 17"):
        kernel.linear_int4(torch.zeros(17, 64), codes, params, 8, None)
    with pytest.raises(RuntimeError, match="x has 128 features, the weight 64"):
        kernel.linear_int4(torch.zeros(1, 128), codes, params, 8, None)
    with pytest.raises(RuntimeError, match="out_features 12 does not match"):
        kernel.linear_int8(torch.zeros(1, 64), packed, torch.ones(12), 12, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel.linear_int8(torch.zeros(1, 64, dtype=torch.float64), packed, torch.ones(8), 8, None)
    with pytest.raises(RuntimeError, match="bias has 3 values"):
        kernel.linear_int8(torch.zeros(1, 64), packed, torch.ones(8), 8, torch.ones(3))


@pytest.mark.parametrize("rows", [1, 16, 17, 40])  # the kernel, then weights widened by chunks
@pytest.mark.parametrize("out_features", [96, 1030])  # 1030: more than one chunk of 1024 rows
def test_int4_linear_equals_the_dequantized_layer(rows, out_features):
    torch.manual_seed(rows)
    w, b, x = torch.randn(out_features, 128), torch.randn(out_features), torch.randn(rows, 128)
    layer = Int4Linear(w, b)
    dequantized = unpack_int4(layer.codes, layer.params, out_features, torch.float64)
    expected = x.double() @ dequantized.T + b.double()
    assert ((layer(x).double() - expected).abs() <= _bound(x, dequantized, torch.float32)).all()
    # 4 bits hold the layer near the full-precision one (measured 8-10% on these normal weights)
    error = (layer(x) - F.linear(x, w, b)).square().mean().sqrt()
    assert 0 < error < 0.15 * F.linear(x, w).square().mean().sqrt()
    padded_rows = -(-out_features // 4) * 4
    assert layer.weight_bytes == padded_rows * 128 // 2 + padded_rows * 2 * 2 * 2  # codes; float16 pairs per group
    with pytest.raises(ValueError, match="multiple of its group size"):
        Int4Linear(torch.zeros(8, 96), None)


def test_int8_linear_keeps_one_copy_of_its_weight():
    w = torch.randn(40, 128)
    layer = Int8Linear(w, None, "int8")
    stored = [name for name, _ in layer.named_buffers()]
    assert "weight_scale" in stored and len(stored) == 2  # the int8 weight once, packed or plain
    assert layer.weight_bytes == 40 * 128 + 40 * 4
    assert torch.equal(layer.weight_int8, torch.round(w / (w.abs().amax(1, keepdim=True) / 127)).to(torch.int8))
