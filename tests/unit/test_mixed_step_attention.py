"""A step mixing decodes with a prompt's prefill attends in two parts, with the same result as
padding every sequence to the longest query (the single-part path it replaces)."""

from __future__ import annotations

import pytest
import torch

from cluster.kernels import build
from cluster.models.layers.attention import PagedAttention
from cluster.runner.input_batch import SHORT_QUERY_MAX, SeqChunk, _attention_metadata, prepare_inputs

BLOCK = 4
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16  # the CPU kernel takes head_dim in multiples of 16


def _mixed_step():
    """A 40-token prompt, a decode, a 3-token verification, a 20-token prefill chunk."""
    chunks = [SeqChunk(list(range(3, 43)), 0, 1), SeqChunk([7], 9, 1), SeqChunk([8, 9, 10], 5, 3),
              SeqChunk(list(range(50, 70)), 8, 1)]
    tables = [list(range(0, 10)), list(range(10, 13)), list(range(13, 15)), list(range(15, 22))]
    return chunks, tables


def test_mixed_step_is_split_into_short_and_long_parts():
    chunks, tables = _mixed_step()
    inputs = prepare_inputs(chunks, tables, BLOCK, torch.device("cpu"))
    attn = inputs.attn
    assert attn.parts is not None and attn.context_slots is None and attn.max_query_len == 40
    (short_tokens, short), (long_tokens, long) = attn.parts
    # Tokens 0-39: the prompt, 40: the decode, 41-43: the verification, 44-63: the chunk.
    assert short_tokens.tolist() == [40, 41, 42, 43]
    assert long_tokens.tolist() == list(range(40)) + list(range(44, 64))
    assert (short.num_seqs, short.max_query_len, long.num_seqs, long.max_query_len) == (2, 3, 2, 40)
    assert short.row_context_lens.tolist() == [10, 6, 7, 8]  # each row sees up to its own position
    assert long.row_context_lens is None and long.query_pad_index is not None
    assert torch.equal(torch.cat([short.slot_mapping, long.slot_mapping]),
                       attn.slot_mapping[torch.cat([short_tokens, long_tokens])])
    # Steps of one kind, and batch-invariant inputs, stay in one part.
    assert prepare_inputs(chunks[1:3], tables[1:3], BLOCK, torch.device("cpu")).attn.parts is None
    assert prepare_inputs(chunks[::3], tables[::3], BLOCK, torch.device("cpu")).attn.parts is None
    assert prepare_inputs(chunks, tables, BLOCK, torch.device("cpu"), short_query_max=None).attn.parts is None


def _one_part(chunks, tables):
    """The whole step as one part: every sequence padded to the longest query."""
    positions = torch.tensor([c.start + i for c in chunks for i in range(len(c.token_ids))])
    whole = prepare_inputs(chunks, tables, BLOCK, torch.device("cpu"))
    table = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.int64)
    for s, blocks in enumerate(tables):
        table[s, :len(blocks)] = torch.tensor(blocks)
    return _attention_metadata([len(c.token_ids) for c in chunks], [c.start + len(c.token_ids) for c in chunks],
                               table, positions, whole.attn.slot_mapping, BLOCK, SHORT_QUERY_MAX, lambda t: t)


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "cpu-kernel"])
def test_two_parts_attend_like_one_padded_part(kernel):
    ops = build.decode_ops() if kernel else None
    if kernel and ops is None:
        pytest.skip("decode_ops is not available on this CPU")
    chunks, tables = _mixed_step()
    gen = torch.Generator().manual_seed(0)
    num_tokens = sum(len(c.token_ids) for c in chunks)
    q = torch.randn(num_tokens, HEADS * HEAD_DIM, generator=gen)
    k = torch.randn(num_tokens, KV_HEADS * HEAD_DIM, generator=gen)
    v = torch.randn(num_tokens, KV_HEADS * HEAD_DIM, generator=gen)
    # Earlier context already in the cache: random K/V in every slot.
    cache = torch.randn(2, 22 * BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    attn = PagedAttention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5)
    attn.cpu_ops = ops
    split_cache, padded_cache = cache.clone(), cache.clone()
    split = attn(q, k, v, split_cache, prepare_inputs(chunks, tables, BLOCK, torch.device("cpu")).attn)
    padded = attn(q, k, v, padded_cache, _one_part(chunks, tables))
    assert torch.equal(split_cache, padded_cache)  # every new K/V written once, in its slot
    torch.testing.assert_close(split, padded, rtol=1e-5, atol=1e-5)
