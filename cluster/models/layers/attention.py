"""Paged attention in plain torch ops (runs wherever torch runs), with compiled CPU kernels
for short-query steps and for prompts where they are attached.

The batch is flat: ``num_tokens`` query tokens from ``num_seqs`` sequences, sequence
``s`` contributing ``query_lens[s]`` consecutive tokens that sit at the end of its
``context_lens[s]`` tokens. Each layer first writes the new K/V into the paged cache
at ``slot_mapping``, then gathers every sequence's whole context through its block
table (``context_slots``) and runs SDPA with a mask that is causal within the
sequence and hides padding. That path serves prefill, chunked prefill, decode and the
verification of draft tokens on every device. On the CPU, steps of up to
``SHORT_QUERY_MAX`` query tokens per sequence instead run ``cluster/kernels/decode_attention.h``
(see :meth:`PagedAttention.decodes_in_kernel`), one query row at a time through the slot table
(plain or int8 caches),
and in bfloat16 (plain or int8 caches) longer queries run ``cluster/kernels/prefill_attention.cpp``
where it measured faster than SDPA (:meth:`PagedAttention.prefills_in_kernel`).
A step mixing such short queries with longer ones (decodes beside a prompt's prefill)
attends in two parts (``AttentionMetadata.parts``), so decodes are never padded to a prompt.
With ``model.attention: flex`` (CUDA's default) a step instead reads the cache in place
through the block table (``AttentionMetadata.flex``, :mod:`cluster.models.layers.flex_paged`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cluster.models.layers.flex_paged import FlexPagedMetadata, flex_paged_attention


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    context_slots: torch.Tensor | None  # [num_seqs, max_context_len] int64: slots of every context token (padded)
    attn_mask: torch.Tensor | None  # [num_seqs, 1, max_query_len, max_context_len] bool, None = attend all
    query_pad_index: torch.Tensor | None  # [num_tokens] int64 into num_seqs * max_query_len; None when every query_len is 1
    num_seqs: int
    max_query_len: int
    decode_padding: torch.Tensor | None = None  # [num_seqs, 1, 1, max_context_len] bool: True = padding (decode only)
    # Short-query steps only (None otherwise): each query row's own context, as if it were a
    # one-token decode: its sequence's slots, up to and including its own position.
    row_context_lens: torch.Tensor | None = None  # [num_tokens] int64
    row_context_slots: torch.Tensor | None = None  # [num_tokens, max_context_len] int64
    # A step mixing short and long queries: (the part's token indices [part_tokens] int64 into the
    # step's tokens, the part's own metadata) per part; the fields above other than slot_mapping,
    # num_seqs and max_query_len are then unused (context_slots None).
    parts: tuple[tuple[torch.Tensor, "AttentionMetadata"], ...] | None = None
    # The flex path (context_slots, attn_mask and the row fields then None): the step's block mask.
    flex: FlexPagedMetadata | None = None
    # Long queries with a mask: (first row, end row, keys) per block of padded query rows, each block
    # attending only to the keys its rows can see (``input_batch.query_blocks``); None: one call.
    # A mask-free step with queries (``attn_mask`` None, ``query_pad_index`` set) is one causal prompt.
    query_blocks: tuple[tuple[int, int, int], ...] | None = None
    # Steps with queries (``query_pad_index`` set) on the gathering path: each sequence's query and
    # context length, [num_seqs] int64 each (the compiled CPU prefill attention's input).
    query_lens: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None


class PagedAttention(torch.nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.cpu_ops = None  # compiled CPU decode attention, set by attach_decode_ops
        self.cpu_prefill = None  # compiled CPU prefill attention (bfloat16), set by attach_decode_ops

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        kv_cache,  # [2, num_slots, num_kv_heads, head_dim] tensor, or an Int8LayerCache
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        num_tokens = q.shape[0]
        if meta.parts is not None:
            out = q.new_empty(num_tokens, self.num_heads * self.head_dim)
            for tokens, part in meta.parts:
                part_out = self.forward(q.index_select(0, tokens), k.index_select(0, tokens),
                                        v.index_select(0, tokens), kv_cache, part)
                out.index_copy_(0, tokens, part_out)
            return out
        if self.decodes_in_kernel(kv_cache, meta):
            values, scales = _kernel_cache(kv_cache)
            return self.cpu_ops.paged_decode_attention(
                q.contiguous(), k.contiguous(), v.contiguous(), values, meta.slot_mapping,
                meta.row_context_slots, meta.row_context_lens, self.num_heads, self.scale, scales)
        new_k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        new_v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if meta.flex is not None:
            kv_cache[0].index_copy_(0, meta.slot_mapping, new_k)
            kv_cache[1].index_copy_(0, meta.slot_mapping, new_v)
            out = flex_paged_attention(q.view(num_tokens, self.num_heads, self.head_dim), kv_cache, meta.flex,
                                       self.scale)
            return out.reshape(num_tokens, self.num_heads * self.head_dim)
        if self.prefills_in_kernel(kv_cache, meta):
            _write(kv_cache, meta.slot_mapping, new_k, new_v)
            values, scales = _kernel_cache(kv_cache)
            return self.cpu_prefill.paged_prefill_attention(q.contiguous(), values, meta.context_slots,
                                                            meta.query_lens, meta.context_lens, self.num_heads,
                                                            self.scale, scales)
        flat_slots = meta.context_slots.view(-1)
        _write(kv_cache, meta.slot_mapping, new_k, new_v)
        if isinstance(kv_cache, torch.Tensor):
            keys, values = kv_cache[0].index_select(0, flat_slots), kv_cache[1].index_select(0, flat_slots)
        else:  # a quantized layer cache (cluster.quant.kv_int8.Int8LayerCache)
            keys, values = kv_cache.gather(flat_slots)
        gather_shape = (meta.num_seqs, -1, self.num_kv_heads, self.head_dim)
        keys = keys.view(gather_shape)  # [num_seqs, ctx, num_kv_heads, head_dim]
        values = values.view(gather_shape)
        if meta.query_pad_index is None:
            return self._decode(q, keys, values, meta)

        q = q.view(num_tokens, self.num_heads, self.head_dim)
        padded = q.new_zeros(meta.num_seqs * meta.max_query_len, self.num_heads, self.head_dim)
        padded.index_copy_(0, meta.query_pad_index, q)
        queries = padded.view(meta.num_seqs, meta.max_query_len, self.num_heads, self.head_dim)
        queries, keys, values = queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        gqa = self.num_heads != self.num_kv_heads
        if meta.attn_mask is None:  # one whole prompt: causal, nothing else hidden
            out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=self.scale,
                                                 enable_gqa=gqa)
        elif meta.query_blocks is None:
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.attn_mask, scale=self.scale,
                                                 enable_gqa=gqa)
        else:
            out = torch.cat([F.scaled_dot_product_attention(
                queries[:, :, first:end], keys[:, :, :num_keys], values[:, :, :num_keys],
                attn_mask=meta.attn_mask[:, :, first:end, :num_keys], scale=self.scale, enable_gqa=gqa)
                for first, end, num_keys in meta.query_blocks], dim=2)
        # out: [num_seqs, num_heads, max_query_len, head_dim]
        out = out.transpose(1, 2).reshape(-1, self.num_heads * self.head_dim)
        return out.index_select(0, meta.query_pad_index)

    def decodes_in_kernel(self, kv_cache, meta: AttentionMetadata) -> bool:
        """Whether this step runs in the compiled CPU kernel: a short-query step (decode or
        draft verification: every query row has its own context) over a plain or an int8
        KV cache, with the kernel attached. The kernel computes every row the same way
        whatever the step holds, so a verified draft token gets bit for bit the logits
        plain decoding would have given it."""
        return self.cpu_ops is not None and meta.row_context_lens is not None

    def prefills_in_kernel(self, kv_cache, meta: AttentionMetadata) -> bool:
        """Whether this step's queries attend in the compiled CPU prefill kernel: a step with
        queries (prompts, prompt chunks) on the gathering path, over a bfloat16 KV cache or an int8
        one widened to bfloat16 (the kernel widens it exactly as :meth:`Int8LayerCache.gather` does),
        with the kernel attached (where it measured faster than SDPA: ``cluster.kernels.prefill_choice``)."""
        if self.cpu_prefill is None or meta.query_lens is None:
            return False
        if isinstance(kv_cache, torch.Tensor):
            return kv_cache.dtype == torch.bfloat16
        return kv_cache.compute_dtype == torch.bfloat16

    def rotary_decode(
        self,
        qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin_signed: [num_tokens, 1, head_dim] each
        kv_cache,  # [2, num_slots, num_kv_heads, head_dim] tensor, or an Int8LayerCache
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        """Rotary on Q and K, the K/V write and attention in one kernel call, one query row at
        a time; only where :meth:`decodes_in_kernel` holds."""
        values, scales = _kernel_cache(kv_cache)
        return self.cpu_ops.rotary_decode_attention(
            qkv.contiguous(), rope[0], rope[1], values, meta.slot_mapping, meta.row_context_slots,
            meta.row_context_lens, self.num_heads, self.scale, scales)

    def _decode(
        self,
        q: torch.Tensor,  # [num_seqs, num_heads * head_dim]
        keys: torch.Tensor,  # [num_seqs, ctx, num_kv_heads, head_dim]
        values: torch.Tensor,  # [num_seqs, ctx, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_seqs, num_heads * head_dim]
        """One query per sequence: two batched matmuls, the query heads of a KV head grouped
        together (GQA without repeating K/V); softmax in float32."""
        num_seqs = q.shape[0]
        group = self.num_heads // self.num_kv_heads
        queries = q.view(num_seqs, self.num_kv_heads, group, self.head_dim)
        scores = torch.matmul(queries * self.scale, keys.permute(0, 2, 3, 1))  # [num_seqs, num_kv_heads, group, ctx]
        if meta.decode_padding is not None:  # [num_seqs, 1, 1, ctx]
            scores = scores.masked_fill(meta.decode_padding, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
        out = torch.matmul(probs, values.transpose(1, 2))  # [num_seqs, num_kv_heads, group, head_dim]
        return out.reshape(num_seqs, self.num_heads * self.head_dim)


def _write(kv_cache, slot_mapping: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor) -> None:
    """The step's new K/V [num_tokens, num_kv_heads, head_dim] into the cache at ``slot_mapping``."""
    if isinstance(kv_cache, torch.Tensor):
        kv_cache[0].index_copy_(0, slot_mapping, new_k)
        kv_cache[1].index_copy_(0, slot_mapping, new_v)
    else:  # a quantized layer cache (cluster.quant.kv_int8.Int8LayerCache)
        kv_cache.write(slot_mapping, new_k, new_v)


def _kernel_cache(kv_cache) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the compiled decode kernel reads: a plain cache tensor (no scales), or an int8 layer
    cache's values [2, num_slots, num_kv_heads, head_dim] and scales [2, num_slots, num_kv_heads]."""
    if isinstance(kv_cache, torch.Tensor):
        return kv_cache, None
    return kv_cache.values, kv_cache.scales
