"""Paged attention that reads the KV cache in place through the block table, with torch's
``flex_attention`` (the CUDA path: ``model.attention: flex``).

The whole cache of a layer is one long key sequence, ``[1, num_kv_heads, num_slots,
head_dim]`` (a strided view, nothing copied), shared by every sequence of the step. A
:class:`BlockMask` lists, for each sequence, its own blocks in the order of its block table
(so the kernel visits only them, in place), and a ``mask_mod`` keeps, inside those blocks,
the keys at or before each query's position.

The mask needs a key's position in its sequence. A KV block sits at the same place in
every sequence that holds it: prefix caching shares a block only between prompts whose
whole prefix up to and including it is the same (chained block hashes), so the block's
index in the block table is a property of the block. ``block_position[b]`` (one entry per
block of the cache, -1 for blocks no sequence of the step holds) carries it, and
``table[s, block_position[b]] == b`` checks that block ``b`` is sequence ``s``'s own.

On CUDA the attention is compiled (``torch.compile``: Triton's flex decoding and flex
attention kernels). torch's uncompiled flex attention is a dense reference over every
slot of the cache; it runs on the CPU, where the tests check this path against the
gathering one, and is refused on CUDA, where it would hold ``num_seqs x num_slots``
scores per head.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

Q_BLOCK = 128  # query rows per block of the mask (flex's default tile)


@dataclass
class FlexPagedMetadata:
    """What the flex path needs for a step (or a part of one), shared by every layer."""

    block_mask: BlockMask
    query_pad_index: torch.Tensor  # [num_tokens] int64 into num_seqs * max_query_len
    num_seqs: int
    max_query_len: int


def build_flex_metadata(
    table: torch.Tensor,  # [num_seqs, max_blocks] int64, rows padded with -1
    query_lens: torch.Tensor,  # [num_seqs] int64
    context_lens: torch.Tensor,  # [num_seqs] int64
    query_pad_index: torch.Tensor,  # [num_tokens] int64
    block_size: int,
    num_blocks: int,  # blocks in the cache
    to,  # moves a tensor to the step's device
) -> FlexPagedMetadata:
    """The step's block mask, from host tensors (built on the host, moved once)."""
    num_seqs, max_blocks = table.shape
    max_query_len = int(query_lens.max())
    blocks_used = (context_lens + block_size - 1) // block_size
    block_position = torch.full((num_blocks,), -1, dtype=torch.int64)
    logical = torch.arange(max_blocks).expand(num_seqs, -1)
    held = logical < blocks_used[:, None]
    block_position[table[held]] = logical[held]
    # Query row i of sequence s sits at position context_len - query_len + i; padding rows
    # repeat the last position (never an empty row) and are dropped after the attention.
    rows = torch.arange(max_query_len)[None, :].minimum(query_lens[:, None] - 1)
    query_pos = context_lens[:, None] - query_lens[:, None] + rows

    device_table, device_position, device_query_pos = to(table), to(block_position), to(query_pos)

    def mask_mod(b, h, q_idx, kv_idx):
        block = kv_idx // block_size
        index = device_position[block]
        own = device_table[b, index.clamp(min=0)] == block
        return (index >= 0) & own & (index * block_size + kv_idx % block_size <= device_query_pos[b, q_idx])

    q_rows = (max_query_len + Q_BLOCK - 1) // Q_BLOCK
    kv_num_blocks = blocks_used.to(torch.int32).view(num_seqs, 1, 1).expand(-1, -1, q_rows).contiguous()
    kv_indices = table.clamp(min=0).to(torch.int32).view(num_seqs, 1, 1, max_blocks)
    kv_indices = kv_indices.expand(-1, -1, q_rows, -1).contiguous()
    block_mask = BlockMask.from_kv_blocks(
        to(kv_num_blocks), to(kv_indices), BLOCK_SIZE=(Q_BLOCK, block_size), mask_mod=mask_mod,
        seq_lengths=(max_query_len, num_blocks * block_size), compute_q_blocks=False)
    return FlexPagedMetadata(block_mask, query_pad_index, num_seqs, max_query_len)


def flex_paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_slots, num_kv_heads, head_dim], the new K/V already written
    meta: FlexPagedMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_tokens, num_heads, head_dim = q.shape
    padded = q.new_zeros(meta.num_seqs * meta.max_query_len, num_heads, head_dim)
    padded.index_copy_(0, meta.query_pad_index, q)
    queries = padded.view(meta.num_seqs, meta.max_query_len, num_heads, head_dim).transpose(1, 2)
    keys = kv_cache[0].permute(1, 0, 2).unsqueeze(0)  # [1, num_kv_heads, num_slots, head_dim], a view
    values = kv_cache[1].permute(1, 0, 2).unsqueeze(0)
    out = _attend(q.device.type)(queries, keys, values, block_mask=meta.block_mask, scale=scale,
                                 enable_gqa=num_heads != keys.shape[1])
    out = out.transpose(1, 2).reshape(-1, num_heads, head_dim)
    return out.index_select(0, meta.query_pad_index)


@lru_cache(maxsize=None)
def _attend(device_type: str):
    """The flex attention a device runs: compiled on CUDA, torch's reference on the CPU."""
    if device_type == "cuda":
        return torch.compile(flex_attention, dynamic=True)
    if device_type == "cpu":
        return flex_attention
    raise ValueError(f"model.attention flex runs on cuda (compiled) or the cpu (reference), not {device_type}")


def flex_unavailable(device: torch.device) -> str | None:
    """Why the flex path cannot run on ``device`` (None: it can)."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"model.attention flex needs CUDA or the CPU, not {device.type}"
    from torch.utils._triton import has_triton  # here, not at the top: a private helper only CUDA needs

    if not has_triton():
        return "model.attention flex on CUDA needs Triton (it compiles flex_attention), which is not installed"
    return None
