"""GGUF's quantized blocks served as they are: torch's dequantization against the gguf package's, value
for value, and the few-row kernel (gguf_gemm) against float64 products of the same values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from cluster.kernels.build import gguf_gemm
from cluster.models.gguf_blocks import FORMATS, block_format, dequantize_rows, row_bytes

kernel = gguf_gemm()
needs_kernel = pytest.mark.skipif(kernel is None, reason="gguf_gemm needs AVX2/AVX-512 and a compiler")

# where each format keeps its float16 fields (random bytes there could be inf or NaN)
_HALF_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_rows(name: str, rows: int, in_features: int, seed: int = 0, half_scale: float = 0.02) -> torch.Tensor:
    """[rows, row_bytes] uint8 of random codes and scales, float16 fields finite, in (0.05, 1.05) x half_scale."""
    fmt = block_format(name)
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (rows * in_features // fmt.block_size, fmt.type_size), generator=generator,
                        dtype=torch.uint8)
    for start in _HALF_FIELDS[name]:
        halves = ((torch.rand(raw.shape[0], generator=generator) + 0.05) * half_scale).half()
        raw[:, start:start + 2] = halves.view(torch.uint8).view(-1, 2)
    return raw.reshape(rows, row_bytes(fmt, in_features))


@pytest.mark.parametrize("name", list(FORMATS))
def test_dequantize_rows_equals_the_gguf_package(name):
    raw = random_rows(name, 5, 512, seed=1)
    ours = dequantize_rows(raw, block_format(name))
    theirs = dequantize(raw.numpy(), GGMLQuantizationType[name])
    assert ours.shape == (5, 512) and ours.dtype == torch.float32
    assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(theirs, dtype=np.float32)))


def test_formats_match_the_gguf_package_sizes():
    from gguf.constants import GGML_QUANT_SIZES

    for fmt in FORMATS.values():
        qtype = GGMLQuantizationType(fmt.ggml_type)
        assert qtype.name == fmt.name and GGML_QUANT_SIZES[qtype] == (fmt.block_size, fmt.type_size)


def test_bad_shapes_and_formats_are_refused_with_what_was_wrong():
    with pytest.raises(ValueError, match="not served.*Q4_0"):
        block_format("IQ2_XXS")
    with pytest.raises(ValueError, match="do not divide a row of 100"):
        row_bytes(block_format("Q4_K"), 100)
    with pytest.raises(ValueError, match="whole 20-byte blocks"):
        dequantize_rows(torch.zeros(2, 30, dtype=torch.uint8), block_format("Q4_1"))


def _reference(x: torch.Tensor, raw: torch.Tensor, name: str, residual: bool = False) -> torch.Tensor:
    """float64 products of the dequantized weight with x as the kernel quantizes it (int8 per 32; with the
    residual, the codes and what they missed, two internal rows a row)."""
    codes, scales = kernel.quantize_activations(x.contiguous(), residual)
    parts = (codes.double().view(codes.shape[0], -1, 32) * scales.double()[..., None]).view(codes.shape)
    x_used = parts.view(x.shape[0], -1, x.shape[1]).sum(dim=1)
    return x_used @ dequantize_rows(raw, block_format(name)).double().T


@needs_kernel
def test_activation_codes_are_round_to_nearest_of_the_chunk_maximum():
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(2))
    x[1, 32:64] = 0.0  # a chunk of zeros: scale 0, codes 0
    codes, scales = kernel.quantize_activations(x, False)
    chunks = x.view(3, 3, 32)
    amax = chunks.abs().amax(-1)
    assert torch.equal(scales, amax / 127)
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    assert torch.equal(codes.view(3, 3, 32), torch.round(chunks * inverse[..., None]).to(torch.int8))
    # with the residual, row 2m + 1 quantizes what row 2m's codes missed: together about 15 bits
    both, both_scales = kernel.quantize_activations(x, True)
    assert torch.equal(both[0::2], codes) and torch.equal(both_scales[0::2], scales)
    rebuilt = (both.float().view(6, 3, 32) * both_scales[..., None]).view(3, 2, 96).sum(dim=1)
    assert ((rebuilt - x).abs() <= amax.repeat_interleave(32, dim=1) / 127 / 254 * 1.01 + 1e-12).all()


@needs_kernel
@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 16, 37])
@pytest.mark.parametrize("residual", [False, True])
def test_kernel_equals_float64_products_of_the_same_values(name, rows, residual):
    in_features = 768 if FORMATS[name].block_size == 256 else 576
    raw = random_rows(name, 37, in_features, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(100 + rows))
    bias = torch.randn(37, generator=torch.Generator().manual_seed(7))
    y = kernel.linear(x, raw, FORMATS[name].ggml_type, bias, residual)
    expected = _reference(x, raw, name, residual) + bias.double()
    magnitude = x.double().abs() @ dequantize_rows(raw, block_format(name)).double().abs().T
    assert y.dtype == torch.float32 and y.shape == (rows, 37)
    assert ((y.double() - expected).abs() <= magnitude * 1e-5 + 1e-5).all()


@needs_kernel
@pytest.mark.parametrize("name", ["Q4_1", "Q6_K"])
def test_a_row_gets_the_same_result_whatever_shares_the_call(name):
    in_features = 512
    raw = random_rows(name, 40, in_features, seed=3)
    x = torch.randn(16, in_features, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    for residual in (False, True):
        together = kernel.linear(x, raw, FORMATS[name].ggml_type, None, residual)
        assert together.dtype == torch.bfloat16
        for m in (0, 5, 15):
            alone = kernel.linear(x[m:m + 1].contiguous(), raw, FORMATS[name].ggml_type, None, residual)
            assert torch.equal(alone, together[m:m + 1])


@needs_kernel
def test_kernel_refuses_bad_calls_with_what_was_wrong():
    raw = random_rows("Q4_1", 8, 64)
    with pytest.raises(RuntimeError, match="1 to 64 rows"):
        kernel.linear(torch.randn(65, 64), raw, 3, None, False)
    with pytest.raises(RuntimeError, match="is not served"):
        kernel.linear(torch.randn(1, 64), raw, 6, None, False)
    with pytest.raises(RuntimeError, match="x has 96 features"):
        kernel.linear(torch.randn(1, 96), raw, 3, None, False)
    with pytest.raises(RuntimeError, match="bias has 3 values"):
        kernel.linear(torch.randn(1, 64), raw, 3, torch.zeros(3), False)


@needs_kernel
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 4, 7, 16])
@pytest.mark.parametrize("residual", [False, True])
def test_tiles_of_8_rows_give_the_rows_kernel_values(name, rows, residual):
    """The tile layout only reorders the bytes: the products equal the float64 reference as the rows' do,
    with out_features not a multiple of 8 (zero rows pad the last tile)."""
    from cluster.quant.gguf_tiles import tile_rows

    raw = random_rows(name, 29, 576, seed=rows)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    bias = torch.randn(29, generator=torch.Generator().manual_seed(9))
    tiles = tile_rows(raw, FORMATS[name])
    assert tiles.data.shape[0] == 4
    y = kernel.linear_tiles(x, tiles.data, tiles.kind, 29, bias, residual)
    expected = _reference(x.float(), raw, name, residual) + bias.double()
    magnitude = x.double().abs() @ dequantize_rows(raw, block_format(name)).double().abs().T
    assert y.dtype == torch.bfloat16
    assert ((y.double() - expected).abs() <= magnitude * 1e-5 + 1e-5 + expected.abs() * 2 ** -8).all()
    # a row alone gets the same bits as beside others
    assert torch.equal(kernel.linear_tiles(x[-1:].contiguous(), tiles.data, tiles.kind, 29, bias, residual), y[-1:])
    with pytest.raises(RuntimeError, match="laid out by cluster.quant.gguf_tiles"):
        kernel.linear_tiles(x, tiles.data, tiles.kind, 33, bias, residual)
