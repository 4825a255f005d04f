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

Shapes (:class:`FlexLayout`): the block table is always ``table_width`` wide, and a decode
step's sequences are padded up to a bucket (rows without blocks, whose output is zero and
dropped), so decode steps come in a few fixed shapes: the compiled decoding kernel is built
once per bucket and a CUDA graph can replay it (``cluster/runner/decode_graphs.py``). So do
verify steps of small batches: their rows padded the same way and each row's queries (its
token and drafts) up to a query bucket, the padding queries repeating the row's last position.

On CUDA the attention is compiled (``torch.compile``: Triton's flex decoding kernel for the
bucketed decode shapes, flex attention with dynamic shapes for the rest). torch's
uncompiled flex attention is a dense reference over every slot of the cache: it runs on
the CPU, where the tests check this path against the gathering one, and never on CUDA,
where it would hold ``num_seqs x num_slots`` scores per head.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

Q_BLOCK = 128  # query rows per block of the mask (flex's default tile)


@dataclass(frozen=True)
class FlexLayout:
    """The fixed shapes of a runner's flex steps."""

    num_blocks: int  # blocks of the cache tensor (the block manager's, plus any scratch block)
    table_width: int  # block-table columns of every step: ceil(max_model_len / block_size)
    decode_buckets: tuple[int, ...] = ()  # a decode step's sequence count is padded up to one of these
    # A verify step (each sequence's token and its drafts, up to k + 1 queries) of at most
    # max(verify_buckets) sequences: its sequence count padded up to one of verify_buckets, and
    # every sequence's queries to the smallest of query_buckets that holds the longest.
    verify_buckets: tuple[int, ...] = ()
    query_buckets: tuple[int, ...] = ()

    def decode_rows(self, num_seqs: int) -> int:
        """Rows of a decode step of ``num_seqs`` sequences: the smallest bucket that holds them
        (the count itself past the largest bucket, or without buckets)."""
        return next((b for b in sorted(self.decode_buckets) if b >= num_seqs), num_seqs)

    def step_shape(self, num_seqs: int, max_query_len: int) -> tuple[int, int, bool]:
        """(rows, queries per row, whether the shape is a bucket's) of a step of ``num_seqs``
        sequences whose longest has ``max_query_len`` queries."""
        if max_query_len == 1 and self.decode_buckets:
            return self.decode_rows(num_seqs), 1, True
        if (self.verify_buckets and self.query_buckets and num_seqs <= max(self.verify_buckets)
                and max_query_len <= max(self.query_buckets)):
            rows = min(b for b in self.verify_buckets if b >= num_seqs)
            return rows, min(q for q in self.query_buckets if q >= max_query_len), True
        return num_seqs, max_query_len, False


@dataclass
class FlexPagedMetadata:
    """What the flex path needs for a step (or a part of one), shared by every layer. The
    tensors the mask reads are kept, so a CUDA graph's static copy can be refreshed."""

    block_mask: BlockMask
    query_pad_index: torch.Tensor  # [num_tokens] int64 into num_rows * max_query_len
    num_rows: int  # sequences, plus padding rows
    max_query_len: int
    table: torch.Tensor  # [num_rows, table_width] int64, -1 past each sequence's blocks
    block_position: torch.Tensor  # [num_blocks] int64
    query_pos: torch.Tensor  # [num_rows, max_query_len] int64
    static_shape: bool  # a bucket's shape, decode or verify (compiled without dynamic shapes)


def build_flex_metadata(
    table: torch.Tensor,  # [num_seqs, max_blocks] int64, rows padded with -1
    query_lens: torch.Tensor,  # [num_seqs] int64
    context_lens: torch.Tensor,  # [num_seqs] int64
    query_pad_index: torch.Tensor,  # [num_tokens] int64, on the step's device
    block_size: int,
    layout: FlexLayout,
    to,  # moves a tensor to the step's device
) -> FlexPagedMetadata:
    """The step's block mask, from host tensors (built on the host, moved once)."""
    num_seqs, max_blocks = table.shape
    rows, max_query_len, static_shape = layout.step_shape(num_seqs, int(query_lens.max()))
    width = max(layout.table_width, max_blocks)
    padded_table = torch.full((rows, width), -1, dtype=torch.int64)
    padded_table[:num_seqs, :max_blocks] = table
    blocks_used = torch.zeros(rows, dtype=torch.int64)
    blocks_used[:num_seqs] = (context_lens + block_size - 1) // block_size
    block_position = torch.full((layout.num_blocks,), -1, dtype=torch.int64)
    logical = torch.arange(width).expand(rows, -1)
    held = logical < blocks_used[:, None]
    block_position[padded_table[held]] = logical[held]
    # Query row i of sequence s sits at position context_len - query_len + i; padding rows
    # repeat the last position (never an empty row) and are dropped after the attention.
    query_pos = torch.zeros(rows, max_query_len, dtype=torch.int64)
    steps = torch.arange(max_query_len)[None, :].minimum(query_lens[:, None] - 1)
    query_pos[:num_seqs] = context_lens[:, None] - query_lens[:, None] + steps

    device_table, device_position, device_query_pos = to(padded_table), to(block_position), to(query_pos)
    q_rows = (max_query_len + Q_BLOCK - 1) // Q_BLOCK
    kv_num_blocks = blocks_used.to(torch.int32).view(rows, 1, 1).expand(-1, -1, q_rows).contiguous()
    kv_indices = padded_table.clamp(min=0).to(torch.int32).view(rows, 1, 1, width).expand(-1, -1, q_rows, -1)
    block_mask = paged_block_mask(to(kv_num_blocks), to(kv_indices.contiguous()), device_table, device_position,
                                  device_query_pos, block_size, max_query_len, layout.num_blocks)
    return FlexPagedMetadata(block_mask, query_pad_index, rows, max_query_len, device_table, device_position,
                             device_query_pos, static_shape)


def paged_block_mask(kv_num_blocks: torch.Tensor, kv_indices: torch.Tensor, table: torch.Tensor,
                     block_position: torch.Tensor, query_pos: torch.Tensor, block_size: int, max_query_len: int,
                     num_blocks: int) -> BlockMask:
    """The block mask over the cache's slots that these tensors describe (they are read, not
    copied, whenever the mask is applied)."""

    def mask_mod(b, h, q_idx, kv_idx):
        block = kv_idx // block_size
        index = block_position[block]
        own = table[b, index.clamp(min=0)] == block
        return (index >= 0) & own & (index * block_size + kv_idx % block_size <= query_pos[b, q_idx])

    return BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=(Q_BLOCK, block_size), mask_mod=mask_mod,
                                    seq_lengths=(max_query_len, num_blocks * block_size), compute_q_blocks=False)


def flex_paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_slots, num_kv_heads, head_dim], the new K/V already written
    meta: FlexPagedMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_tokens, num_heads, head_dim = q.shape
    padded = q.new_zeros(meta.num_rows * meta.max_query_len, num_heads, head_dim)
    padded.index_copy_(0, meta.query_pad_index, q)
    queries = padded.view(meta.num_rows, meta.max_query_len, num_heads, head_dim).transpose(1, 2)
    keys = kv_cache[0].permute(1, 0, 2).unsqueeze(0)  # [1, num_kv_heads, num_slots, head_dim], a view
    values = kv_cache[1].permute(1, 0, 2).unsqueeze(0)
    block_size = meta.block_mask.BLOCK_SIZE[1]
    attend, options = _attend(q.device.type, meta.static_shape), _kernel_options(q.device.type, block_size)
    out = attend(queries, keys, values, block_mask=meta.block_mask, scale=scale,
                 enable_gqa=num_heads != keys.shape[1], kernel_options=options)
    out = out.transpose(1, 2).reshape(-1, num_heads, head_dim)
    return out.index_select(0, meta.query_pad_index)


@lru_cache(maxsize=None)
def _attend(device_type: str, static_shape: bool):
    """The flex attention a device runs: compiled on CUDA, torch's reference on the CPU."""
    if device_type == "cuda":
        return compiled_flex(static_shape)
    if device_type == "cpu":
        return flex_attention
    raise ValueError(f"model.attention flex runs on cuda (compiled) or the cpu (reference), not {device_type}")


def compiled_flex(static_shape: bool, backend: str = "inductor"):
    """flex_attention compiled as one graph: for fixed shapes (the decode buckets) or dynamic ones."""
    # Each decode bucket is one compiled shape, the other steps a few dynamic ones; past the
    # default limit of 8 dynamo would run the dense reference instead.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(flex_attention, dynamic=not static_shape, fullgraph=True, backend=backend)


def _kernel_options(device_type: str, block_size: int) -> dict | None:
    """Triton's key tile must divide the cache block: blocks under 64 tokens set it to the block."""
    return {"BLOCK_N": block_size} if device_type == "cuda" and block_size < 64 else None


def flex_unavailable(device: torch.device, block_size: int) -> str | None:
    """Why the flex path cannot run on ``device`` (None: it can)."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"model.attention flex needs CUDA or the CPU, not {device.type}"
    if block_size < 16 or block_size & (block_size - 1):
        return f"model.attention flex on CUDA needs cache.block_size a power of two of at least 16, got {block_size}"
    from torch.utils._triton import has_triton  # here, not at the top: a private helper only CUDA needs

    if not has_triton():
        return "model.attention flex on CUDA needs Triton (it compiles flex_attention), which is not installed"
    return None
