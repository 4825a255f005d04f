"""Turning a scheduled step into the flat tensors one forward pass needs."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from cluster.models.layers.attention import AttentionMetadata
from cluster.models.layers.flex_paged import FlexLayout, build_flex_metadata

# Up to this many query tokens per sequence (decode, draft verification, small prefill chunks)
# every query row also gets its own context (see AttentionMetadata.row_context_lens).
SHORT_QUERY_MAX = 16
# Longer queries (prefill) attend QUERY_BLOCK_ROWS rows at a time, each block to the keys up to
# its last row only, so the kernel skips most of the causal mask's hidden half: on a 2-core Zen 4,
# 1,731 prompt tokens' attention took 34.9 ms a layer in blocks of 256 against 50.4 in one call
# (blocks of 128: 40.7, of 512: 37.7).
QUERY_BLOCK_ROWS = 256


class SeqChunk(NamedTuple):
    """New tokens of one sequence for one forward pass."""

    token_ids: list[int]  # the tokens to compute, at positions start, start + 1, ...
    start: int  # tokens already in the KV cache before them
    num_logits: int  # how many of the last positions need logits (0 for a mid-prefill chunk)
    lora_slot: int = 0  # the LoRA adapter its tokens run with (0: none; cluster/models/lora.py)


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [num_logits]: flat indices of the positions that need logits, chunk by chunk


def prepare_inputs(
    chunks: list[SeqChunk],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    short_query_max: int | None = SHORT_QUERY_MAX,
    flex: FlexLayout | None = None,
) -> ModelInputs:
    """Flat token ids and positions, cache slots, and the attention mask of one pass.

    Chunk ``s`` computes tokens at positions ``[start, start + len(token_ids))`` and
    attends to all ``start + len(token_ids)`` tokens of its context. Query rows get their
    own contexts (the CPU kernel's input) in steps of at most ``short_query_max`` tokens
    per sequence; None gives them in every step (batch-invariant mode; it holds
    ``num_tokens x max_context_len`` slot indices). A step that mixes short chunks (decodes,
    draft verification) with longer ones (prefill) attends in two parts, each padded only to
    its own longest query: 24 decodes beside a 72-token prompt took a pass 205 ms padded
    to the prompt and 47 ms split (SmolLM2-135M, 2-core CPU). ``flex`` gives the flex path's
    metadata (its fixed shapes) instead of gathered contexts; the parts stay.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    query_lens: list[int] = []
    context_lens: list[int] = []
    logits_indices: list[int] = []
    for chunk in chunks:
        start, n = chunk.start, len(chunk.token_ids)
        input_ids.extend(chunk.token_ids)
        positions.extend(range(start, start + n))
        query_lens.append(n)
        context_lens.append(start + n)
        logits_indices.extend(range(len(input_ids) - chunk.num_logits, len(input_ids)))

    num_seqs = len(chunks)
    max_blocks = max(len(t) for t in block_tables)
    # Padding: -1 for the flex mask (no block), 0 for the gathering path (masked out). One tensor
    # from padded lists: a tensor and a copy per row took 2.7 ms at 128 rows, this 0.3.
    pad = -1 if flex is not None else 0
    table = torch.tensor([blocks + [pad] * (max_blocks - len(blocks)) for blocks in block_tables], dtype=torch.int64)
    positions_t = torch.tensor(positions, dtype=torch.int64)
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), torch.tensor(query_lens, dtype=torch.int64))
    slot_mapping = table[seq_of_token, positions_t // block_size] * block_size + positions_t % block_size

    def to(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device, non_blocking=True)

    short = [s for s, n in enumerate(query_lens) if short_query_max is not None and n <= short_query_max]
    if not short or len(short) == num_seqs:
        attn = _attention_metadata(query_lens, context_lens, table, positions_t, slot_mapping, block_size,
                                   short_query_max, to, flex)
    else:
        long = sorted(set(range(num_seqs)) - set(short))
        starts = [0, *itertools.accumulate(query_lens)]  # sequence s holds tokens starts[s] .. starts[s + 1] - 1
        parts = []
        for seqs in (short, long):
            tokens = torch.tensor([i for s in seqs for i in range(starts[s], starts[s + 1])], dtype=torch.int64)
            part = _attention_metadata([query_lens[s] for s in seqs], [context_lens[s] for s in seqs], table[seqs],
                                       positions_t[tokens], slot_mapping[tokens], block_size, short_query_max, to,
                                       flex)
            parts.append((to(tokens), part))
        attn = AttentionMetadata(slot_mapping=to(slot_mapping), context_slots=None, attn_mask=None,
                                 query_pad_index=None, num_seqs=num_seqs, max_query_len=max(query_lens),
                                 parts=tuple(parts))
    return ModelInputs(
        input_ids=to(torch.tensor(input_ids, dtype=torch.int64)),
        positions=to(positions_t),
        attn=attn,
        logits_indices=to(torch.tensor(logits_indices, dtype=torch.int64)),
    )


def _attention_metadata(
    query_lens: list[int],
    context_lens: list[int],
    table: torch.Tensor,  # [num_seqs, max_blocks] int64
    positions_t: torch.Tensor,  # [num_tokens] int64, these sequences' tokens in order
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    block_size: int,
    short_query_max: int | None,
    to,  # moves a tensor (or None) to the step's device
    flex: FlexLayout | None = None,
) -> AttentionMetadata:
    """The attention inputs of the sequences whose rows of the block table ``table`` holds."""
    num_seqs = len(query_lens)
    max_query_len = max(query_lens)
    max_context_len = max(context_lens)
    query_lens_t = torch.tensor(query_lens, dtype=torch.int64)
    context_lens_t = torch.tensor(context_lens, dtype=torch.int64)
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), query_lens_t)
    if flex is not None:
        starts = torch.cumsum(query_lens_t, 0) - query_lens_t
        _, row_len, _ = flex.step_shape(num_seqs, max_query_len)  # a verify bucket pads each row's queries
        query_pad_index = seq_of_token * row_len + torch.arange(len(positions_t)) - starts[seq_of_token]
        meta = build_flex_metadata(table, query_lens_t, context_lens_t, to(query_pad_index), block_size, flex, to)
        return AttentionMetadata(slot_mapping=to(slot_mapping), context_slots=None, attn_mask=None,
                                 query_pad_index=None, num_seqs=num_seqs, max_query_len=max_query_len, flex=meta)

    context_pos = torch.arange(max_context_len)
    context_slots = table.gather(1, (context_pos // block_size).expand(num_seqs, -1)) * block_size
    context_slots = context_slots + context_pos % block_size  # [num_seqs, max_context_len]

    if max_query_len == 1:
        query_pad_index = None
        if min(context_lens) == max_context_len:
            attn_mask = None
        else:
            attn_mask = (context_pos[None, :] < context_lens_t[:, None]).view(num_seqs, 1, 1, -1)
    else:
        starts = torch.cumsum(query_lens_t, 0) - query_lens_t
        offset_in_seq = torch.arange(len(positions_t)) - starts[seq_of_token]
        query_pad_index = seq_of_token * max_query_len + offset_in_seq
        if num_seqs == 1 and context_lens[0] == query_lens[0]:
            attn_mask = None  # a whole prompt alone: plain causal attention (is_causal)
        else:
            # Query row i of sequence s sits at position context_len - query_len + i.
            query_pos = context_lens_t[:, None] - query_lens_t[:, None] + torch.arange(max_query_len)[None, :]
            attn_mask = (context_pos[None, None, :] <= query_pos[:, :, None]) & (
                context_pos[None, None, :] < context_lens_t[:, None, None]
            )
            attn_mask = attn_mask.unsqueeze(1)  # [num_seqs, 1, max_query_len, max_context_len]

    row_context_lens = row_context_slots = None
    if short_query_max is None or max_query_len <= short_query_max:
        row_context_lens = positions_t + 1  # a query row sees the context up to its own position
        row_context_slots = context_slots if max_query_len == 1 else context_slots[seq_of_token]

    return AttentionMetadata(
        slot_mapping=to(slot_mapping),
        context_slots=to(context_slots),
        attn_mask=to(attn_mask),
        query_pad_index=to(query_pad_index),
        num_seqs=num_seqs,
        max_query_len=max_query_len,
        query_blocks=query_blocks(query_lens, context_lens) if attn_mask is not None else None,
        decode_padding=to(~attn_mask) if query_pad_index is None and attn_mask is not None else None,
        row_context_lens=to(row_context_lens),
        row_context_slots=to(row_context_slots),
        query_lens=None if query_pad_index is None else to(query_lens_t),
        context_lens=None if query_pad_index is None else to(context_lens_t),
    )


def query_blocks(query_lens: list[int], context_lens: list[int],
                 rows: int = QUERY_BLOCK_ROWS) -> tuple[tuple[int, int, int], ...] | None:
    """(first row, end row, keys) per block of ``rows`` padded query rows: row ``i`` of sequence ``s``
    sits at position ``context_lens[s] - query_lens[s] + i`` and sees no key past it, so a block needs
    the keys up to the furthest its rows reach in any sequence. None when one block would do."""
    max_query_len = max(query_lens)
    if max_query_len <= rows:
        return None
    blocks = []
    for first in range(0, max_query_len, rows):
        end = min(first + rows, max_query_len)
        blocks.append((first, end, max(min(c, c - q + end) for q, c in zip(query_lens, context_lens))))
    return tuple(blocks)
