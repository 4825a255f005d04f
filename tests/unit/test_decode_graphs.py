"""Decode and verify steps through a bucket's static tensors (what a CUDA graph replays) give the
hidden states (and a draft head's aux states) of the plain flex path, and their padding rows and
queries write only the scratch block.

Capture itself needs CUDA (tests/gpu/validate.py); here ``capture=False`` runs the same static
tensors through the model eagerly, step after step, so stale rows of a bigger earlier step
would show up as writes into live slots."""

from __future__ import annotations

import pytest
import torch

from cluster.config import config_from_dict
from cluster.models.layers.flex_paged import FlexLayout
from cluster.runner.decode_graphs import DecodeGraphs, decode_buckets, query_buckets, verify_buckets
from cluster.runner.input_batch import SeqChunk, prepare_inputs
from cluster.runner.worker import load_model

BLOCK, NUM_BLOCKS = 4, 48  # the pool; the cache holds one more block, the scratch one
CPU = torch.device("cpu")
LAYOUT = FlexLayout(NUM_BLOCKS + 1, table_width=8, decode_buckets=(1, 4, 8), verify_buckets=(1, 2, 4),
                    query_buckets=(2, 3, 5))
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


def _verify_step(drafts: list[int], step: int) -> tuple[list[SeqChunk], list[list[int]]]:
    """Sequence s verifies its last token and ``drafts[s]`` drafts after 9 + s + 3 * step tokens."""
    chunks, tables = [], []
    for s, k in enumerate(drafts):
        start = 9 + s + 3 * step
        chunks.append(SeqChunk([3 + s + j for j in range(k + 1)], start, k + 1))
        tables.append([5 * s + j for j in range(-(-(start + k + 1) // BLOCK))])
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
        assert graphs.covers(inputs) and inputs.attn.flex.num_rows == LAYOUT.decode_rows(batch)
        with torch.inference_mode():
            replayed = graphs.forward(inputs)
            plain = model.model(inputs.input_ids, inputs.positions, plain_cache, inputs.attn)
        torch.testing.assert_close(replayed, plain, rtol=1e-5, atol=1e-5)
        # Every live slot holds the same K/V on both paths; only the scratch block differs.
        torch.testing.assert_close(cache[:, :, :SCRATCH], plain_cache[:, :, :SCRATCH], rtol=1e-5, atol=1e-5)
    assert not torch.equal(cache[:, :, SCRATCH:], plain_cache[:, :, SCRATCH:])  # the padding rows wrote there


def test_steps_that_are_not_bucketed_decodes_are_not_covered(model):
    spec = model.spec
    cache = torch.zeros(spec.num_layers, 2, (NUM_BLOCKS + 1) * BLOCK, spec.num_kv_heads, spec.head_dim)
    graphs = DecodeGraphs(model.model, cache, LAYOUT, BLOCK, SCRATCH, CPU, capture=False)
    prefill = [SeqChunk(list(range(3, 9)), 0, 1)]  # 6 queries: past the largest query bucket
    assert not graphs.covers(prepare_inputs(prefill, [[0, 1]], BLOCK, CPU, flex=LAYOUT))
    chunks, tables = _decode_step(9, 0)  # past the largest bucket
    assert not graphs.covers(prepare_inputs(chunks, tables, BLOCK, CPU, flex=LAYOUT))
    chunks, tables = _verify_step([2] * 5, 0)  # a verify step of more sequences than its buckets hold
    assert not graphs.covers(prepare_inputs(chunks, tables, BLOCK, CPU, flex=LAYOUT))
    with pytest.raises(ValueError, match="captured on CUDA"):
        DecodeGraphs(model.model, cache, LAYOUT, BLOCK, SCRATCH, CPU, capture=True)


def test_buckets_end_at_max_num_seqs_and_verify_buckets_are_few():
    assert decode_buckets(1) == (1,)
    assert decode_buckets(40) == (1, 2, 4, 8, 16, 24, 32, 40)
    assert decode_buckets(300)[-2:] == (256, 300)
    assert verify_buckets(256) == (1, 2, 4, 8, 16, 24, 32) and verify_buckets(6) == (1, 2, 4, 6)
    assert query_buckets(0) == () and query_buckets(1) == (2,) and query_buckets(4) == (2, 3, 5)
    assert query_buckets(8) == (2, 3, 5, 9) and query_buckets(6) == (2, 3, 5, 7)


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
        assert graphs.covers(inputs)
        with torch.inference_mode():
            replayed = graphs.forward(inputs, torch.tensor(slots))
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


@pytest.mark.parametrize("aux_layers", [(), (0, 1)])
def test_verify_steps_padded_to_their_bucket_match_the_plain_flex_path(model, aux_layers):
    """Sequences with different numbers of drafts (0 to 4), padded to a bucket's rows and queries:
    the hidden states of every token, and a draft head's aux states, equal the plain path's; the
    padding writes only the scratch block; steps alternate with decode steps through the same cache."""
    spec = model.spec
    model.model.aux_layer_ids = aux_layers
    try:
        cache = torch.randn(spec.num_layers, 2, (NUM_BLOCKS + 1) * BLOCK, spec.num_kv_heads, spec.head_dim,
                            generator=torch.Generator().manual_seed(1))
        graphs = DecodeGraphs(model.model, cache, LAYOUT, BLOCK, SCRATCH, CPU, capture=False)
        assert graphs.summary["graphs"] == 0 and len(graphs.buckets) == 3 + 3 * 3  # a dry run builds, never captures
        plain_cache = cache.clone()
        # (rows, queries) buckets: (4, 5), (2, 3), decode (4, 1), (1, 2), (4, 5) again with other rows live
        for step, drafts in enumerate(([4, 0, 2], [1, 2], [0, 0, 0], [1], [0, 3, 4, 1])):
            chunks, tables = _verify_step(drafts, step)
            inputs = prepare_inputs(chunks, tables, BLOCK, CPU, flex=LAYOUT)
            flex = inputs.attn.flex
            assert graphs.covers(inputs) and flex.max_query_len == min(q for q in (1, 2, 3, 5) if q > max(drafts))
            assert flex.num_rows == min(r for r in (1, 2, 4) if r >= len(drafts))
            with torch.inference_mode():
                replayed = graphs.forward(inputs)
                replayed_aux = model.model.aux_hidden
                plain = model.model(inputs.input_ids, inputs.positions, plain_cache, inputs.attn)
                plain_aux = model.model.aux_hidden
            assert replayed.shape[0] == sum(drafts) + len(drafts)
            torch.testing.assert_close(replayed, plain, rtol=1e-5, atol=1e-5)
            if aux_layers:
                assert replayed_aux.shape == (replayed.shape[0], len(aux_layers) * replayed.shape[1])
                torch.testing.assert_close(replayed_aux, plain_aux, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(cache[:, :, :SCRATCH], plain_cache[:, :, :SCRATCH], rtol=1e-5, atol=1e-5)
        assert not torch.equal(cache[:, :, SCRATCH:], plain_cache[:, :, SCRATCH:])
    finally:
        model.model.aux_layer_ids = ()


def test_head_passes_padded_to_their_bucket_match_the_plain_flex_path(model):
    """An EAGLE-3 head's catch-up passes (verify shapes) and one-token draft passes (decode shapes
    up to the widest verify bucket) through the static tensors: the same hidden states and logits
    as the plain flex path, padding written only into the scratch block, passes interleaved over
    one head cache."""
    from cluster.models.tiny_head import random_head, tiny_head_config
    from cluster.spec_decode.head_graphs import HeadGraphs, head_shapes

    config = model.model.config
    head = random_head(tiny_head_config(config, 64), seed=3).eval()
    embed = model.model.embed_tokens
    c = head.config
    cache = torch.randn(2, (NUM_BLOCKS + 1) * BLOCK, c.num_kv_heads, c.head_dim,
                        generator=torch.Generator().manual_seed(2))
    graphs = HeadGraphs(head, embed, cache, LAYOUT, BLOCK, SCRATCH, CPU, capture=False)
    assert set(graphs.buckets) == set(head_shapes(LAYOUT)) == {(1, 1), (4, 1)} | {
        (r, q) for r in (1, 2, 4) for q in (2, 3, 5)}  # the decode bucket 8 is wider than any verify bucket
    plain_cache = cache.clone()
    gen = torch.Generator().manual_seed(4)
    steps = [_verify_step([2, 0, 4], 0), _decode_step(3, 1), _decode_step(1, 2), _verify_step([1, 3], 1),
             _decode_step(4, 3)]
    for chunks, tables in steps:
        inputs = prepare_inputs(chunks, tables, BLOCK, CPU, flex=LAYOUT)
        assert graphs.covers(inputs)
        hidden = torch.randn(inputs.input_ids.shape[0], c.hidden_size, generator=gen)
        with torch.inference_mode():
            out, logits = graphs.forward(inputs, hidden)
            plain = head(embed(inputs.input_ids), hidden, inputs.positions, plain_cache, inputs.attn)
        torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits, head.logits(plain), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache[:, :SCRATCH], plain_cache[:, :SCRATCH], rtol=1e-5, atol=1e-5)
    assert not torch.equal(cache[:, SCRATCH:], plain_cache[:, SCRATCH:])
    assert graphs.summary["passes"] == {"catch_up": 2, "draft": 3} and graphs.summary["graphs"] == 0
    chunks, tables = _decode_step(5, 0)  # 5 one-token passes: bucket 8, past the widest verify bucket
    assert not graphs.covers(prepare_inputs(chunks, tables, BLOCK, CPU, flex=LAYOUT))
    with pytest.raises(ValueError, match="captured on CUDA"):
        HeadGraphs(head, embed, cache, LAYOUT, BLOCK, SCRATCH, CPU, capture=True)


@pytest.mark.parametrize("method", ["ngram", "draft", "eagle3"])
def test_the_engine_speculates_exactly_through_the_buckets_of_a_cuda_plan(method, tiny_llama_dir, tiny_head_dir,
                                                                          monkeypatch):
    """The dry run of what a CUDA engine captures: the attention plan a CUDA device gets (decode and
    verify buckets, graphs on), here on the CPU, where each covered step runs its bucket's static
    tensors eagerly. Greedy speculation through it equals plain decoding, and verify steps went
    through the buckets."""
    from cluster.runner import attention_choice, worker
    from cluster.shared.sampling_params import SamplingParams
    from tests.engine_helpers import make_engine, run_to_completion

    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5, list(range(20, 47)), [3] * 6]  # repeats: n-grams find drafts
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    settings = dict(num_blocks=96, block_size=8, max_num_seqs=4, attention="flex")
    expected = run_to_completion(make_engine(tiny_llama_dir, **settings), prompts, greedy)

    monkeypatch.setattr(attention_choice, "flex_unavailable", lambda device, block_size: None)
    real = worker.choose_attention
    monkeypatch.setattr(worker, "choose_attention", lambda config, device, max_model_len, *rest: real(
        config, torch.device("cuda"), max_model_len, *rest))
    spec = {"ngram": dict(method="ngram"),
            "draft": dict(method="draft", draft_model=str(tiny_llama_dir)),
            "eagle3": dict(method="eagle3", draft_model=str(tiny_head_dir))}[method]
    engine = make_engine(tiny_llama_dir, num_speculative_tokens=4, **spec, **settings)
    graphs = engine.worker.runner.graphs
    assert graphs is not None and graphs.summary["verify_queries"] == [2, 3, 5] and graphs.summary["graphs"] == 0
    shapes = []
    forward = graphs.forward

    def counted(inputs, token_slots=None):
        shapes.append((inputs.attn.flex.num_rows, inputs.attn.flex.max_query_len))
        return forward(inputs, token_slots)

    graphs.forward = counted
    assert run_to_completion(engine, prompts, greedy) == expected
    assert any(q > 1 for _, q in shapes), shapes  # verify steps replayed their buckets
    if method == "eagle3":  # so did the head's catch-up and draft passes
        passes = engine.proposer.graphs.summary["passes"]
        assert passes["catch_up"] > 0 and passes["draft"] > 0, passes
