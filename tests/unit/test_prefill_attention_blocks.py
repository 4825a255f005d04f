"""Long prefill attends in blocks of query rows, each to the keys its rows can see, and a whole
prompt alone attends causally without a mask; both give what attention over each row's own
context gives (computed here row by row in float64)."""

from __future__ import annotations

import pytest
import torch

from cluster.models.layers.attention import PagedAttention
from cluster.runner.input_batch import QUERY_BLOCK_ROWS, SeqChunk, prepare_inputs, query_blocks

BLOCK = 16
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def test_blocks_reach_the_keys_their_rows_can_see():
    # One 600-token chunk after a 100-token prefix: rows 0-255 see up to position 355, and so on.
    assert query_blocks([600], [700]) == ((0, 256, 356), (256, 512, 612), (512, 600, 700))
    # Two sequences padded to 600 rows: a block needs the furthest any of them reaches.
    assert query_blocks([600, 300], [600, 1000]) == ((0, 256, 956), (256, 512, 1000), (512, 600, 1000))
    assert query_blocks([QUERY_BLOCK_ROWS], [5000]) is None  # one block: one call


def _reference(chunks, cache, q, k, v, tables):
    """Each query row over its own context, in float64, from the cache with the new K/V written."""
    cache = cache.clone().double()
    group = HEADS // KV_HEADS
    out, row = [], 0
    for chunk, table in zip(chunks, tables):
        for i in range(len(chunk.token_ids)):
            pos = chunk.start + i
            slot = table[pos // BLOCK] * BLOCK + pos % BLOCK
            cache[0, slot], cache[1, slot] = k[row + i].view(KV_HEADS, HEAD_DIM), v[row + i].view(KV_HEADS, HEAD_DIM)
        for i in range(len(chunk.token_ids)):
            pos = chunk.start + i
            slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(pos + 1)])
            keys, values = cache[0, slots], cache[1, slots]  # [ctx, kv_heads, head_dim]
            query = q[row + i].double().view(HEADS, HEAD_DIM)
            heads = []
            for h in range(HEADS):
                scores = keys[:, h // group] @ query[h] * HEAD_DIM ** -0.5
                heads.append(torch.softmax(scores, 0) @ values[:, h // group])
            out.append(torch.cat(heads))
        row += len(chunk.token_ids)
    return torch.stack(out)


@pytest.mark.parametrize("case", ["whole prompt", "chunk after a prefix", "two sequences"])
def test_blocked_and_causal_prefill_attend_as_each_row_alone(case):
    chunks = {"whole prompt": [SeqChunk(list(range(600)), 0, 1)],
              "chunk after a prefix": [SeqChunk(list(range(520)), 300, 1)],
              "two sequences": [SeqChunk(list(range(530)), 40, 1), SeqChunk(list(range(270)), 400, 1)]}[case]
    tables, next_block = [], 0
    for chunk in chunks:
        num_blocks = -(-(chunk.start + len(chunk.token_ids)) // BLOCK)
        tables.append(list(range(next_block, next_block + num_blocks)))
        next_block += num_blocks
    inputs = prepare_inputs(chunks, tables, BLOCK, torch.device("cpu"))
    meta = inputs.attn
    if case == "whole prompt":
        assert meta.attn_mask is None and meta.query_blocks is None
    else:
        assert meta.attn_mask is not None and len(meta.query_blocks) == 3
    gen = torch.Generator().manual_seed(0)
    num_tokens = sum(len(c.token_ids) for c in chunks)
    q = torch.randn(num_tokens, HEADS * HEAD_DIM, generator=gen)
    k = torch.randn(num_tokens, KV_HEADS * HEAD_DIM, generator=gen)
    v = torch.randn(num_tokens, KV_HEADS * HEAD_DIM, generator=gen)
    cache = torch.randn(2, next_block * BLOCK, KV_HEADS, HEAD_DIM, generator=gen)  # the prefixes' K/V
    expected = _reference(chunks, cache, q, k, v, tables)
    out = PagedAttention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5)(q, k, v, cache.clone(), meta)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)
