"""Paged attention in plain torch ops (runs wherever torch runs).

The batch is flat: ``num_tokens`` query tokens from ``num_seqs`` sequences, sequence
``s`` contributing ``query_lens[s]`` consecutive tokens that sit at the end of its
``context_lens[s]`` tokens. Each layer first writes the new K/V into the paged cache
at ``slot_mapping``, then gathers every sequence's whole context through its block
table (``context_slots``) and runs SDPA with a mask that is causal within the
sequence and hides padding. One code path serves prefill, chunked prefill, decode and
the verification of draft tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    context_slots: torch.Tensor  # [num_seqs, max_context_len] int64: slots of every context token (padded)
    attn_mask: torch.Tensor | None  # [num_seqs, 1, max_query_len, max_context_len] bool, None = attend all
    query_pad_index: torch.Tensor | None  # [num_tokens] int64 into num_seqs * max_query_len; None when every query_len is 1
    num_seqs: int
    max_query_len: int


class PagedAttention(torch.nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        kv_cache: torch.Tensor,  # [2, num_slots, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        num_tokens = q.shape[0]
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        k_cache.index_copy_(0, meta.slot_mapping, k.view(num_tokens, self.num_kv_heads, self.head_dim))
        v_cache.index_copy_(0, meta.slot_mapping, v.view(num_tokens, self.num_kv_heads, self.head_dim))

        # [num_seqs, num_kv_heads, max_context_len, head_dim]
        gather_shape = (meta.num_seqs, -1, self.num_kv_heads, self.head_dim)
        flat_slots = meta.context_slots.view(-1)
        keys = k_cache.index_select(0, flat_slots).view(gather_shape).transpose(1, 2)
        values = v_cache.index_select(0, flat_slots).view(gather_shape).transpose(1, 2)

        q = q.view(num_tokens, self.num_heads, self.head_dim)
        if meta.query_pad_index is None:  # every sequence has one query token
            queries = q.unsqueeze(2)  # [num_seqs, num_heads, 1, head_dim]
        else:
            padded = q.new_zeros(meta.num_seqs * meta.max_query_len, self.num_heads, self.head_dim)
            padded.index_copy_(0, meta.query_pad_index, q)
            queries = padded.view(meta.num_seqs, meta.max_query_len, self.num_heads, self.head_dim)
            queries = queries.transpose(1, 2)

        out = F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=meta.attn_mask,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # [num_seqs, num_heads, max_query_len, head_dim]
        out = out.transpose(1, 2).reshape(-1, self.num_heads * self.head_dim)
        if meta.query_pad_index is not None:
            out = out.index_select(0, meta.query_pad_index)
        return out
