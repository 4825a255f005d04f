"""The GGUF (ggml) block formats Tandem serves as they are, and their dequantization in torch.

A quantized GGUF weight of shape [N, K] is N rows of ``K / block_size`` blocks, each block a fixed
number of bytes; Tandem keeps it as those bytes, a uint8 tensor [N, row_bytes], and never refits
it. The formats (``w`` a weight, ``q`` its code, float16 fields widened exactly):

- ``Q4_0``, 32 weights in 18 bytes: float16 ``d``, 16 bytes of codes (byte j: weight j in the low
  nibble, weight 16 + j in the high one); ``w = d * (q - 8)``.
- ``Q4_1``, 32 in 20: ``d``, ``m``, codes as Q4_0; ``w = d * q + m``.
- ``Q8_0``, 32 in 34: ``d``, 32 int8 codes; ``w = d * q``.
- ``Q4_K``, 256 in 144: ``d``, ``dmin``, 12 bytes of eight 6-bit (scale, min) pairs, 128 bytes of
  codes (32-byte group g: sub-block 2g in the low nibbles, 2g + 1 in the high ones);
  sub-block j of 32 weights: ``w = d * scale_j * q - dmin * min_j``.
- ``Q5_K``, 256 in 176: as Q4_K with a fifth bit per code (bit j of byte l of 32 bytes ``qh`` is
  the high bit of weight l of sub-block j), laid ``d, dmin, scales, qh, qs``.
- ``Q6_K``, 256 in 210: 128 bytes of low nibbles ``ql``, 64 of high bit pairs ``qh``, 16 int8 scales
  (one per 16 weights), float16 ``d`` last; ``w = d * scale * (q - 32)``, q in [0, 63]. Chunk c of
  32 weights (half h = c // 4, quarter r = c % 4): low nibble of ``ql[64h + 32(r % 2) + l]`` (high
  nibble from r = 2 on), bits ``2r, 2r + 1`` of ``qh[32h + l]``.

:func:`dequantize_rows` is checked value for value against the ``gguf`` package's numpy
dequantization (tests/unit/test_gguf_blocks.py); it runs on any device, so the layers that hold
these bytes widen them where no compiled kernel takes the call.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file


class BlockFormat(NamedTuple):
    name: str
    ggml_type: int  # the GGMLQuantizationType value in the file
    block_size: int  # weights per block
    type_size: int  # bytes per block


FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    BlockFormat("Q4_0", 2, 32, 18),
    BlockFormat("Q4_1", 3, 32, 20),
    BlockFormat("Q8_0", 8, 32, 34),
    BlockFormat("Q4_K", 12, 256, 144),
    BlockFormat("Q5_K", 13, 256, 176),
    BlockFormat("Q6_K", 14, 256, 210),
)}
FORMAT_OF_TYPE: dict[int, BlockFormat] = {f.ggml_type: f for f in FORMATS.values()}


def block_format(name: str) -> BlockFormat:
    """The format called ``name`` (``Q4_1`` ...), or ValueError listing those served."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"GGUF block format {name!r} is not served as it is; served: {', '.join(FORMATS)}") from None


def row_bytes(fmt: BlockFormat, in_features: int) -> int:
    """Bytes of one row of ``in_features`` weights; ValueError if the blocks do not divide it."""
    if in_features % fmt.block_size:
        raise ValueError(f"{fmt.name} blocks of {fmt.block_size} weights do not divide a row of {in_features}")
    return in_features // fmt.block_size * fmt.type_size


def dequantize_rows(raw: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """raw: [rows, row_bytes] uint8 in ``fmt`` -> [rows, in_features] float32, on raw's device."""
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % fmt.type_size:
        raise ValueError(f"{fmt.name} rows must be a 2-D uint8 tensor of whole {fmt.type_size}-byte blocks, "
                         f"got {tuple(raw.shape)} {raw.dtype}")
    rows, width = raw.shape
    blocks = raw.reshape(rows * (width // fmt.type_size), fmt.type_size)
    weights = _DEQUANTIZE[fmt.name](blocks)  # [num_blocks, block_size]
    return weights.reshape(rows, width // fmt.type_size * fmt.block_size)


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:  # [n, 1] float32 of the float16 at byte start
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(codes: torch.Tensor) -> torch.Tensor:  # [n, b] -> [n, 2b]: the low nibbles, then the high ones
    return torch.cat([codes & 15, codes >> 4], dim=-1)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return _half(blocks, 0) * (_nibbles(blocks[:, 2:]).float() - 8)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _half(blocks, 0) * _nibbles(blocks[:, 4:]).float() + _half(blocks, 2)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return _half(blocks, 0) * blocks[:, 2:].contiguous().view(torch.int8).float()


def k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit (scale, min) pairs of Q4_K / Q5_K from their 12 bytes: ([n, 8], [n, 8]) int."""
    s = scales.long()
    low, high = s[:, :4], s[:, 4:8]
    sc = torch.cat([low & 63, (s[:, 8:12] & 15) | ((low >> 6) << 4)], dim=-1)
    mn = torch.cat([high & 63, (s[:, 8:12] >> 4) | ((high >> 6) << 4)], dim=-1)
    return sc, mn


def _k_codes_4bit(qs: torch.Tensor) -> torch.Tensor:  # [n, 128] -> [n, 8, 32]: sub-block j's low 4 bits
    groups = qs.reshape(-1, 4, 1, 32)
    return torch.cat([groups & 15, groups >> 4], dim=2).reshape(-1, 8, 32)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    sc, mn = k_scales_mins(blocks[:, 4:16])
    q = _k_codes_4bit(blocks[:, 16:144]).float()
    w = (_half(blocks, 0) * sc.float())[..., None] * q - (_half(blocks, 2) * mn.float())[..., None]
    return w.reshape(-1, 256)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    sc, mn = k_scales_mins(blocks[:, 4:16])
    qh = blocks[:, 16:48].long()  # bit j of byte l: the fifth bit of weight l of sub-block j
    bits = (qh[:, None, :] >> torch.arange(8, device=blocks.device)[None, :, None]) & 1
    q = (_k_codes_4bit(blocks[:, 48:176]).long() | (bits << 4)).float()
    w = (_half(blocks, 0) * sc.float())[..., None] * q - (_half(blocks, 2) * mn.float())[..., None]
    return w.reshape(-1, 256)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    ql = blocks[:, :128].long().reshape(-1, 2, 1, 64)
    low = torch.cat([ql & 15, ql >> 4], dim=2).reshape(-1, 2, 4, 32)  # [n, half, quarter, l]
    qh = blocks[:, 128:192].long().reshape(-1, 2, 1, 32)
    high = (qh >> (2 * torch.arange(4, device=blocks.device))[None, None, :, None]) & 3
    q = ((low | (high << 4)) - 32).float().reshape(-1, 16, 16)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
    return ((_half(blocks, 208) * scales)[..., None] * q).reshape(-1, 256)


_DEQUANTIZE = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


BLOCKS_DIR = "gguf_blocks"  # beside a converted folder's weights: not a *.safetensors the weight loader reads
_BLOCKS_FILE = "blocks.safetensors"


def write_blocks(folder: Path, tensors: dict[str, tuple[torch.Tensor, str]]) -> None:
    """Keep ``{HF name: (raw rows, format name)}`` in ``folder/gguf_blocks/`` (nothing when empty)."""
    if not tensors:
        return
    (folder / BLOCKS_DIR).mkdir()
    save_file({name: raw for name, (raw, _) in tensors.items()}, str(folder / BLOCKS_DIR / _BLOCKS_FILE),
              metadata={"formats": json.dumps({name: fmt for name, (_, fmt) in tensors.items()})})


def read_blocks(folder: Path) -> dict[str, tuple[torch.Tensor, BlockFormat]]:
    """The block tensors a converted GGUF folder keeps (``{}`` for any other folder)."""
    path = folder / BLOCKS_DIR / _BLOCKS_FILE
    if not path.is_file():
        return {}
    with safe_open(str(path), framework="pt") as f:
        formats = json.loads(f.metadata()["formats"])
        return {name: (f.get_tensor(name), block_format(formats[name])) for name in f.keys()}
