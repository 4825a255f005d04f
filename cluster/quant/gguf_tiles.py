"""GGUF rows repacked into ``gguf_gemm.linear_tiles``'s tiles of 8 rows: the same codes and scales, reordered.

Q4_0, Q4_1 and Q8_0 keep their codes and float16 scales unchanged (Q4_0's ``w = d * (q - 8)`` becomes scale
``d`` and offset ``-8 * d``, exact in float16); only their order changes, so that a 256-bit vector holds 4
consecutive codes of each of 8 rows and the kernel finishes 8 rows of a chunk in one vector
(``cluster/kernels/gguf_gemm.cpp`` describes the tile). Rows past ``N`` up to a multiple of 8 are zero.
Other formats have no tile layout (:func:`tile_rows` returns None) and run on the file's rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from cluster.models.gguf_blocks import BlockFormat

TILE_ROWS = 8
CHUNK = 32
AFFINE4, INT8 = 0, 1  # the kernel's tile kinds


class Tiles(NamedTuple):
    data: torch.Tensor  # [ceil(N / 8), K / 32 * tile bytes] uint8
    kind: int  # AFFINE4 or INT8


def tile_rows(raw: torch.Tensor, fmt: BlockFormat) -> Tiles | None:
    """raw: [N, row_bytes] uint8 in ``fmt`` -> its tiles, or None where ``fmt`` has no tile layout."""
    if fmt.name not in ("Q4_0", "Q4_1", "Q8_0"):
        return None
    rows = raw.shape[0]
    pad = -rows % TILE_ROWS
    blocks = torch.cat([raw, raw.new_zeros(pad, raw.shape[1])]).view(rows + pad, -1, fmt.type_size)
    groups, chunks = (rows + pad) // TILE_ROWS, blocks.shape[1]
    scale = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]  # [rows, chunks]
    if fmt.name == "Q8_0":
        codes = blocks[..., 2:].reshape(groups, TILE_ROWS, chunks, 8, 4)  # [group, row, chunk, step, 4]
        codes = codes.permute(0, 2, 3, 1, 4).reshape(groups, chunks, 256)
        return Tiles(torch.cat([codes, _halves(scale, groups, chunks)], dim=-1).reshape(groups, -1), INT8)
    if fmt.name == "Q4_1":
        offset, packed = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0], blocks[..., 4:]
    else:
        offset, packed = (scale.float() * -8).half(), blocks[..., 2:]
    q = torch.cat([packed & 15, packed >> 4], dim=-1)  # [rows, chunks, 32]: the block's weights in order
    q = q.reshape(groups, TILE_ROWS, chunks, 8, 4).permute(0, 2, 3, 1, 4)  # [group, chunk, step, row, 4]
    codes = (q[:, :, :4] | (q[:, :, 4:] << 4)).reshape(groups, chunks, 128)
    params = torch.cat([_halves(scale, groups, chunks), _halves(offset, groups, chunks)], dim=-1)
    return Tiles(torch.cat([codes, params], dim=-1).reshape(groups, -1), AFFINE4)


def _halves(values: torch.Tensor, groups: int, chunks: int) -> torch.Tensor:
    """[rows, chunks] float16 -> [group, chunk, 16] bytes: each chunk's 8 rows' values in row order."""
    per_tile = values.reshape(groups, TILE_ROWS, chunks).transpose(1, 2).contiguous()
    return per_tile.view(torch.uint8).reshape(groups, chunks, 2 * TILE_ROWS)
