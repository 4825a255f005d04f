"""Decode steps through a bucket's static tensors (what a CUDA graph replays) give the hidden
states of the plain flex path, and their padding rows write only the scratch block.

Capture itself needs CUDA (tests/gpu/validate.py); here ``capture=False`` runs the same static
tensors through the model eagerly, step after step, so stale rows of a bigger earlier step
would show up as writes into live slots."""

from __future__ import annotations

import pytest
import torch

from cluster.config import config_from_dict
from cluster.models.layers.flex_paged import FlexLayout
from cluster.runner.decode_graphs import DecodeGraphs, decode_buckets
from cluster.runner.input_batch import SeqChunk, prepare_inputs
from cluster.runner.worker import load_model

BLOCK, NUM_BLOCKS = 4, 48  # the pool; the cache holds one more block, the scratch one
CPU = torch.device("cpu")
LAYOUT = FlexLayout(NUM_BLOCKS + 1, table_width=8, decode_buckets=(1, 4, 8))
SCRATCH = NUM_BLOCKS * BLOCK


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    config = config_from_dict({"model": {"model": str(tiny_llama_dir), "dtype": "float32", "attention": "flex"},
                               "cache": {"block_size": BLOCK}, "device": {"device": "cpu"}})
    return load_model(config, CPU)


def _decode_step(batch: int, step: int) -> tuple[list[SeqChunk], list[list[int]]]:
    """Sequence s: context 9 + s + step tokens, its own blocks (5 per sequence)."""
    chunks, tables = [], []
    for s in range(batch):
        start = 8 + s + step
        chunks.append(SeqChunk([3 + s + step], start, 1))
        tables.append([5 * s + j for j in range(-(-(start + 1) // BLOCK))])
    return chunks, tables


def test_bucketed_static_steps_match_the_plain_flex_path(model):
    spec = model.spec
    cache = torch.randn(spec.num_layers, 2, (NUM_BLOCKS + 1) * BLOCK, spec.num_kv_heads, spec.head_dim,
                        generator=torch.Generator().manual_seed(0))
    graphs = DecodeGraphs(model.model, cache, LAYOUT, BLOCK, SCRATCH, CPU, capture=False)
    plain_cache = cache.clone()
    # 5 sequences (bucket 8), then 3 and 2 (bucket 4: row 2 was live, then padding), then 1.
    for step, batch in enumerate((5, 3, 2, 1)):
        chunks, tables = _decode_step(batch, step)
        inputs = prepare_inputs(chunks, tables, BLOCK, CPU, flex=LAYOUT)
        assert graphs.covers(inputs, batch) and inputs.attn.flex.num_rows == LAYOUT.decode_rows(batch)
        with torch.inference_mode():
            replayed = graphs.forward(inputs, batch)
            plain = model.model(inputs.input_ids, inputs.positions, plain_cache, inputs.attn)
        torch.testing.assert_close(replayed, plain, rtol=1e-5, atol=1e-5)
        # Every live slot holds the same K/V on both paths; only the scratch block differs.
        torch.testing.assert_close(cache[:, :, :SCRATCH], plain_cache[:, :, :SCRATCH], rtol=1e-5, atol=1e-5)
    assert not torch.equal(cache[:, :, SCRATCH:], plain_cache[:, :, SCRATCH:])  # the padding rows wrote there


def test_steps_that_are_not_bucketed_decodes_are_not_covered(model):
    spec = model.spec
    cache = torch.zeros(spec.num_layers, 2, (NUM_BLOCKS + 1) * BLOCK, spec.num_kv_heads, spec.head_dim)
    graphs = DecodeGraphs(model.model, cache, LAYOUT, BLOCK, SCRATCH, CPU, capture=False)
    prefill = [SeqChunk(list(range(3, 9)), 0, 1)]
    assert not graphs.covers(prepare_inputs(prefill, [[0, 1]], BLOCK, CPU, flex=LAYOUT), 1)
    verify = [SeqChunk([3, 4, 5], 6, 3)]
    assert not graphs.covers(prepare_inputs(verify, [[0, 1, 2]], BLOCK, CPU, flex=LAYOUT), 1)
    chunks, tables = _decode_step(9, 0)  # past the largest bucket
    assert not graphs.covers(prepare_inputs(chunks, tables, BLOCK, CPU, flex=LAYOUT), 9)
    with pytest.raises(ValueError, match="captured on CUDA"):
        DecodeGraphs(model.model, cache, LAYOUT, BLOCK, SCRATCH, CPU, capture=True)


def test_buckets_end_at_max_num_seqs():
    assert decode_buckets(1) == (1,)
    assert decode_buckets(40) == (1, 2, 4, 8, 16, 24, 32, 40)
    assert decode_buckets(300)[-2:] == (256, 300)


def test_decode_steps_with_adapters_read_the_reserved_stacks_adapters_loaded_later_included(tiny_llama_dir,
                                                                                            tmp_path):
    """With LoRA attached, a decode step with adapter tokens runs through the bucket's ``lora_slots``
    and reads every stack whole (what the second graph of each bucket replays): its hidden states
    equal the eager LoRA path's, for adapters loaded before the graphs and after them (``lora_dir``:
    the stacks are reserved at capacity, so the captured tensors hold them), after an unload, and
    for a step of base rows alone (the padding rows' slot 0)."""
    from cluster.models.lora import LoRABatch, load_adapter
    from tests.lora_helpers import save_peft_adapter

    adapters = tmp_path / "adapters"
    save_peft_adapter(tiny_llama_dir, adapters / "all", seed=1)
    save_peft_adapter(tiny_llama_dir, adapters / "qv", seed=2, targets=["q_proj", "v_proj"], rank=8, alpha=16)
    config = config_from_dict({"model": {"model": str(tiny_llama_dir), "dtype": "float32", "attention": "flex",
                                         "lora_modules": {"all": str(adapters / "all")}, "lora_dir": str(adapters),
                                         "max_loras": 3, "max_lora_rank": 8},
                               "cache": {"block_size": BLOCK}, "device": {"device": "cpu"}})
    loaded = load_model(config, CPU)
    state, spec = loaded.lora, loaded.spec
    cache = torch.randn(spec.num_layers, 2, (NUM_BLOCKS + 1) * BLOCK, spec.num_kv_heads, spec.head_dim,
                        generator=torch.Generator().manual_seed(0))
    graphs = DecodeGraphs(loaded.model, cache, LAYOUT, BLOCK, SCRATCH, CPU, capture=False, lora=state)
    stacks = [part.a for layer in state.modules for module in layer.values() for part in module.parts]
    state.add(load_adapter("qv", adapters / "qv", loaded.model, 8))  # after the "capture"
    plain_cache = cache.clone()
    all_slot, qv_slot = state.slots["all"], state.slots["qv"]
    steps = [[all_slot, 0, qv_slot, qv_slot, 0], [0, all_slot, qv_slot], [0, 0]]
    for step, slots in enumerate(steps):
        if step == 2:
            state.remove("all")
        chunks, tables = _decode_step(len(slots), step)
        inputs = prepare_inputs(chunks, tables, BLOCK, CPU, flex=LAYOUT)
        assert graphs.covers(inputs, len(slots))
        with torch.inference_mode():
            replayed = graphs.forward(inputs, len(slots), torch.tensor(slots))
            state.batch = LoRABatch.from_token_slots(slots, [1] * len(slots), CPU)
            plain = loaded.model(inputs.input_ids, inputs.positions, plain_cache, inputs.attn)
            state.batch = None
            base = loaded.model(inputs.input_ids, inputs.positions, plain_cache.clone(), inputs.attn)
        torch.testing.assert_close(replayed, plain, rtol=1e-5, atol=1e-5)
        if any(slots):
            assert not torch.allclose(replayed, base, rtol=1e-3, atol=1e-3)  # the adapters changed something
    after = [part.a for layer in state.modules for module in layer.values() for part in module.parts]
    assert len(after) == len(stacks) and all(a is b for a, b in zip(after, stacks))  # never moved
    assert {a.shape[0] for a in stacks} == {4 + 2 * 8}  # "all" (rank 4), and room for 2 more of max_lora_rank
