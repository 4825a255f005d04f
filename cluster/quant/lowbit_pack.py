"""The tile layouts of ``cluster/kernels/lowbit_gemm.cpp``'s int8 and 4-bit weights, made and undone
with torch ops (so every device holds the same form, and layers without the compiled kernel, or
calls with more rows than it takes, compute from it too).

Both lay W out as tiles of ``TILE_ROWS`` output rows (rows past ``out_features`` are zero), each tile
one sequential stream: int8 as ``[tiles, K / 64, 4, 64]`` (a 64-byte line of each row in turn);
4-bit codes as bytes ``[tiles, K / G, 4, G / 2]`` (G inputs a group; in each run of 64 inputs byte
j holds input j in its low nibble and input 32 + j in its high one) with float16 (scale, offset)
``[tiles, K / G, 4, 2]`` beside them.
"""

from __future__ import annotations

import torch

TILE_ROWS = 4
INT8_LINE = 64  # int8 inputs a row per line
INT4_RUN = 64  # 4-bit inputs per run of 32 bytes; a group size is a multiple of it


def _tiles(rows: int) -> int:
    return (rows + TILE_ROWS - 1) // TILE_ROWS


def _pad_rows(t: torch.Tensor) -> torch.Tensor:  # [N, ...] -> [tiles * 4, ...], zero rows past N
    pad = _tiles(t.shape[0]) * TILE_ROWS - t.shape[0]
    return t if pad == 0 else torch.cat([t, t.new_zeros(pad, *t.shape[1:])])


def pack_int8(weight_int8: torch.Tensor) -> torch.Tensor:  # [N, K] int8 -> [tiles, K / 64, 4, 64]
    out_features, in_features = weight_int8.shape
    if in_features % INT8_LINE:
        raise ValueError(f"int8 tiles need in_features a multiple of {INT8_LINE}, got {in_features}")
    padded = _pad_rows(weight_int8)
    return padded.view(-1, TILE_ROWS, in_features // INT8_LINE, INT8_LINE).transpose(1, 2).contiguous()


def unpack_int8(packed: torch.Tensor, out_features: int) -> torch.Tensor:  # -> [N, K] int8
    tiles, lines = packed.shape[:2]
    return packed.transpose(1, 2).reshape(tiles * TILE_ROWS, lines * INT8_LINE)[:out_features]


def pack_int4(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [N, K] uint8 codes in [0, 15]; scale, offset: [N, K / G] (float16 values) ->
    (codes [tiles, K / G, 4, G / 2] uint8, params [tiles, K / G, 4, 2] float16)."""
    out_features, in_features = q.shape
    groups = scale.shape[1]
    group_size = in_features // groups
    if groups * group_size != in_features or group_size % INT4_RUN:
        raise ValueError(f"4-bit groups must divide in_features ({in_features}) into multiples of {INT4_RUN} inputs, "
                         f"got {groups} groups")
    padded = _pad_rows(q)
    runs = padded.view(-1, in_features // INT4_RUN, 2, INT4_RUN // 2)
    codes = runs[:, :, 0] | (runs[:, :, 1] << 4)  # [tiles * 4, K / 64, 32]
    codes = codes.reshape(-1, TILE_ROWS, groups, group_size // 2).transpose(1, 2).contiguous()
    params = _pad_rows(torch.stack([scale, offset], dim=-1).to(torch.float16))  # [tiles * 4, groups, 2]
    params = params.view(-1, TILE_ROWS, groups, 2).transpose(1, 2).contiguous()
    return codes, params


def unpack_int4(codes: torch.Tensor, params: torch.Tensor, out_features: int, dtype: torch.dtype,
                tiles: slice = slice(None)) -> torch.Tensor:
    """The dequantized weight (q * scale + offset, in float32 then ``dtype``) of the output rows of
    ``tiles`` (all by default): [rows, K]."""
    codes, params = codes[tiles], params[tiles]
    num_tiles, groups, _, half_group = codes.shape
    in_features = groups * half_group * 2
    runs = codes.view(num_tiles, groups, TILE_ROWS, half_group // (INT4_RUN // 2), INT4_RUN // 2)
    q = torch.stack([runs & 15, runs >> 4], dim=-2)  # [..., runs, 2, 32]
    q = q.permute(0, 2, 1, 3, 4, 5).reshape(num_tiles * TILE_ROWS, groups, half_group * 2)
    p = params.float().transpose(1, 2).reshape(num_tiles * TILE_ROWS, groups, 2)
    weight = (q.float() * p[..., :1] + p[..., 1:]).view(num_tiles * TILE_ROWS, in_features)
    start = (tiles.start or 0) * TILE_ROWS
    return weight[: max(0, out_features - start)].to(dtype)
