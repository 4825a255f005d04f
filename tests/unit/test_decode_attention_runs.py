"""Decode attention over runs of rows (a verify step's rows of one sequence) and over int8 caches
(cluster/kernels/decode_attention.h), against each row alone and against float64 references."""

from __future__ import annotations

import pytest
import torch

from cluster.quant.kv_int8 import quantize_vectors
from tests.unit.test_decode_ops import TOL, _paged_batch, _reference, ops  # noqa: F401 (ops: a fixture)


def _verify_rows(gen, dtype, runs=((509, 9), (40, 4), (700, 1), (250, 8)), num_kv_heads=2, head_dim=32):
    """Rows as a verify step lays them out: run (context, rows) is one sequence whose last ``rows``
    positions are queries, each row with its own copy of the sequence's slots up to itself.
    Contexts cross 256-key chunks inside a run (a run's rows then differ in their number of chunks)."""
    num_slots = sum(n for n, _ in runs) + 32
    perm = torch.randperm(num_slots, generator=gen)
    lens, rows_slots, start = [], [], 0
    for context, rows in runs:
        slots = perm[start : start + context]
        start += context
        for r in range(rows):
            lens.append(context - rows + 1 + r)
            rows_slots.append(slots)
    width = max(n for n, _ in runs)
    context_slots = torch.zeros(len(lens), width, dtype=torch.int64)
    for i, (n, slots) in enumerate(zip(lens, rows_slots)):
        context_slots[i, :n] = slots[:n]
    lens = torch.tensor(lens)
    slot_mapping = torch.stack([context_slots[i, lens[i] - 1] for i in range(len(lens))])
    cache = torch.randn(2, num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    return lens, context_slots, slot_mapping, cache


@pytest.mark.parametrize("cache_kind", ["float32", "bfloat16", "int8"])
def test_verification_rows_read_their_sequence_together_and_each_row_as_alone(ops, cache_kind):
    """The rows of one sequence (a verify step's k + 1 queries) are attended in one pass over the
    sequence's K/V; each row still gets bit for bit what it gets alone in a call."""
    dtype = torch.bfloat16 if cache_kind == "bfloat16" else torch.float32
    gen = torch.Generator().manual_seed(11)
    lens, context_slots, slot_mapping, cache = _verify_rows(gen, dtype)
    scales = None
    if cache_kind == "int8":
        cache, scales = quantize_vectors(cache)
    n = len(lens)
    q = torch.randn(n, 6 * 32, generator=gen).to(dtype)
    k, v = (torch.randn(n, 2 * 32, generator=gen).to(dtype) for _ in range(2))
    together = ops.paged_decode_attention(q, k, v, cache, slot_mapping, context_slots, lens, 6, 0.2, scales)
    for i in range(n):
        # the cache now holds every row's K/V; a row alone reads only the slots up to its own
        alone = ops.paged_decode_attention(q[i : i + 1], k[i : i + 1], v[i : i + 1], cache.clone(),
                                           slot_mapping[i : i + 1], context_slots[i : i + 1].contiguous(),
                                           lens[i : i + 1], 6, 0.2, None if scales is None else scales.clone())
        assert torch.equal(alone[0], together[i]), f"row {i} (context {lens[i].item()})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_cache_attends_like_its_widened_values_and_writes_kv_int8s_quantization(ops, dtype):
    """An int8 cache in the kernel: the new K/V are stored as quantize_vectors stores them, and the
    output is attention over the widened cache (values times scales)."""
    gen = torch.Generator().manual_seed(12)
    lens, context_slots, slot_mapping, cache = _paged_batch(torch.float32, gen, lens=(700, 3, 256, 257, 40))
    values, scales = quantize_vectors(cache * 3)
    q = torch.randn(len(lens), 6 * 32, generator=gen).to(dtype)
    k, v = (torch.randn(len(lens), 2 * 32, generator=gen).to(dtype) for _ in range(2))
    out = ops.paged_decode_attention(q, k, v, values, slot_mapping, context_slots, lens, 6, 0.2, scales)
    for i, new in enumerate((k, v)):
        expected_values, expected_scales = quantize_vectors(new.view(len(lens), 2, 32))
        assert torch.equal(values[i, slot_mapping], expected_values)
        assert torch.equal(scales[i, slot_mapping], expected_scales)
    widened = values.double() * scales.double().unsqueeze(-1)
    expected, _ = _reference(q, widened[0, slot_mapping].flatten(1), widened[1, slot_mapping].flatten(1), widened,
                             slot_mapping, context_slots, lens, 6, 0.2)
    torch.testing.assert_close(out.double(), expected, rtol=TOL[dtype], atol=TOL[dtype])


def test_an_int8_cache_needs_its_scales(ops):
    gen = torch.Generator().manual_seed(13)
    lens, context_slots, slot_mapping, cache = _paged_batch(torch.float32, gen)
    values, scales = quantize_vectors(cache)
    q, k, v = torch.randn(3, 192), torch.randn(3, 64), torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="an int8 cache needs its scales"):
        ops.paged_decode_attention(q, k, v, values, slot_mapping, context_slots, lens, 6, 0.2)
    with pytest.raises(RuntimeError, match="an int8 cache needs its scales"):
        ops.paged_decode_attention(q, k, v, cache, slot_mapping, context_slots, lens, 6, 0.2, scales)
    with pytest.raises(RuntimeError, match="kv_scales must be contiguous float32"):
        ops.paged_decode_attention(q, k, v, values, slot_mapping, context_slots, lens, 6, 0.2, scales[:, :-1])
