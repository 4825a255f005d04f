"""The flex path reads the KV cache in place through the block table and attends exactly like
the gathering path: on steps mixing prefill, chunked prefill, decodes and draft verification,
over scattered blocks and blocks shared by prefix caching. On the CPU it runs torch's
reference flex attention; on CUDA the same metadata goes to the compiled kernels
(tests/gpu/validate.py checks that on a GPU)."""

from __future__ import annotations

import pytest
import torch

from cluster.config import ConfigError, TandemConfig, config_from_dict, with_overrides
from cluster.engine.llm import LLM
from cluster.models.layers.attention import PagedAttention
from cluster.models.layers.flex_paged import FlexLayout
from cluster.runner import attention_choice
from cluster.runner.attention_choice import AttentionPlan, choose_attention
from cluster.runner.input_batch import SeqChunk, prepare_inputs
from cluster.shared.sampling_params import SamplingParams

BLOCK = 4
NUM_BLOCKS = 40
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
CPU = torch.device("cpu")
LAYOUT = FlexLayout(NUM_BLOCKS, table_width=8)
BUCKETED = FlexLayout(NUM_BLOCKS, table_width=8, decode_buckets=(1, 4, 8))  # decode steps padded, as on CUDA


def _step():
    """A 21-token prompt, a decode, a 3-token verification and a 9-token prefill chunk, over
    scattered blocks; sequences 0 and 3 share their first two blocks (a cached prefix)."""
    chunks = [SeqChunk(list(range(3, 24)), 0, 1), SeqChunk([7], 9, 1), SeqChunk([8, 9, 10], 5, 3),
              SeqChunk(list(range(50, 59)), 8, 1)]
    tables = [[31, 5, 17, 2, 38, 11], [0, 22, 9], [14, 27], [31, 5, 36, 19, 8]]
    return chunks, tables


def _attend(chunks, tables, flex: FlexLayout | None, cache: torch.Tensor):
    gen = torch.Generator().manual_seed(1)
    num_tokens = sum(len(c.token_ids) for c in chunks)
    q = torch.randn(num_tokens, HEADS * HEAD_DIM, generator=gen)
    k = torch.randn(num_tokens, KV_HEADS * HEAD_DIM, generator=gen)
    v = torch.randn(num_tokens, KV_HEADS * HEAD_DIM, generator=gen)
    inputs = prepare_inputs(chunks, tables, BLOCK, CPU, flex=flex)
    return PagedAttention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5)(q, k, v, cache, inputs.attn)


def _steps() -> dict:
    chunks, tables = _step()
    decodes = [SeqChunk([7], 9 - s, 1) for s in range(3)], [[0, 22, 9], [0, 22, 9], [3, 22, 1]]
    return {"mixed": (chunks, tables), "short-only": (chunks[1:], tables[1:]), "prefill-only": (chunks[:1], tables[:1]),
            "one-decode": (chunks[1:2], tables[1:2]), "three-decodes": decodes}


@pytest.mark.parametrize("layout", [LAYOUT, BUCKETED], ids=["exact", "bucketed"])
@pytest.mark.parametrize("step", list(_steps()))
def test_flex_attends_like_the_gathering_path(step, layout):
    chunks, tables = _steps()[step]
    cache = torch.randn(2, NUM_BLOCKS * BLOCK, KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    flex_cache, gather_cache = cache.clone(), cache.clone()
    flex = _attend(chunks, tables, layout, flex_cache)
    gathered = _attend(chunks, tables, None, gather_cache)
    assert torch.equal(flex_cache, gather_cache)  # the new K/V written in their slots, once
    torch.testing.assert_close(flex, gathered, rtol=1e-5, atol=1e-5)


def test_the_mask_visits_only_each_sequences_own_blocks_in_table_order():
    chunks, tables = _step()
    attn = prepare_inputs(chunks, tables, BLOCK, CPU, flex=LAYOUT).attn
    (_, short), (_, long) = attn.parts  # queries of up to 16 tokens apart from the prompt, as on the other path
    for part, seqs in ((short, [1, 2, 3]), (long, [0])):
        mask = part.flex.block_mask
        for row, s in enumerate(seqs):
            context = chunks[s].start + len(chunks[s].token_ids)
            used = -(-context // BLOCK)
            assert mask.kv_num_blocks[row, 0, 0].item() == used
            assert mask.kv_indices[row, 0, 0, :used].tolist() == tables[s][:used]


def test_a_changed_slot_outside_a_sequences_blocks_changes_nothing():
    """In place means in place: K/V in blocks no sequence of the step holds are never read."""
    chunks, tables = _step()
    cache = torch.randn(2, NUM_BLOCKS * BLOCK, KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    other = cache.clone()
    held = {b for t in tables for b in t}
    for block in set(range(NUM_BLOCKS)) - held:
        other[:, block * BLOCK:(block + 1) * BLOCK] = 1e4
    torch.testing.assert_close(_attend(chunks, tables, LAYOUT, cache), _attend(chunks, tables, LAYOUT, other))


def test_engine_greedy_and_speculative_outputs_are_the_same_with_flex(tiny_llama_dir):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 17, 41, 30)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outputs = {}
    for attention in ("gather", "flex"):
        for spec in ({}, {"method": "draft", "draft_model": str(tiny_llama_dir),
                          "num_speculative_tokens": 3}):
            llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_blocks=64, block_size=8,
                      max_num_batched_tokens=32, attention=attention, **spec)
            assert llm.engine.worker.runner.attention == attention
            outs = llm.generate(prompts, params)
            llm.engine.check_invariants()
            outputs[attention, bool(spec)] = [o.outputs[0].token_ids for o in outs]
    assert outputs["flex", False] == outputs["gather", False] == outputs["flex", True]


def test_flex_is_refused_where_it_cannot_serve():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        config_from_dict({"model": {"attention": "flex"}, "cache": {"kv_cache_dtype": "int8"}})
    with pytest.raises((ValueError, ConfigError), match="batch_invariant"):
        config_from_dict({"model": {"attention": "flex", "batch_invariant": True}})
    with pytest.raises(ValueError, match="needs CUDA or the CPU, not meta"):
        choose_attention(TandemConfig(model={"attention": "flex"}), torch.device("meta"), 64)


def test_auto_takes_flex_on_cuda_only_with_a_plain_cache(monkeypatch):
    assert choose_attention(TandemConfig(), CPU, 64) == AttentionPlan()
    assert choose_attention(TandemConfig(model={"attention": "flex"}), CPU, 64) == AttentionPlan("flex", 4)
    int8 = config_from_dict({"cache": {"kv_cache_dtype": "int8"}})
    assert choose_attention(int8, torch.device("cuda"), 64).path == "gather"  # no CUDA needed to decide that
    with pytest.raises(ValueError, match="block_size a power of two"):
        choose_attention(config_from_dict({"cache": {"block_size": 8}}), torch.device("cuda"), 64)
    # What a CUDA machine with Triton gets (this one has neither: the check is stood in for).
    monkeypatch.setattr(attention_choice, "flex_unavailable", lambda device, block_size: None)
    cuda, config = torch.device("cuda"), config_from_dict({"scheduler": {"max_num_seqs": 40}})
    plan = choose_attention(config, cuda, 100)
    assert plan == AttentionPlan("flex", 7, (1, 2, 4, 8, 16, 24, 32, 40), cuda_graphs=True)
    speculating = with_overrides(config, method="ngram", num_speculative_tokens=6)
    assert choose_attention(speculating, cuda, 100) == AttentionPlan(
        "flex", 7, (1, 2, 4, 8, 16, 24, 32, 40), (1, 2, 4, 8, 16, 24, 32), (2, 3, 5, 7), cuda_graphs=True)
    assert not choose_attention(config, cuda, 100, tensor_parallel=True).cuda_graphs
    assert not choose_attention(with_overrides(config, enforce_eager=True), cuda, 100).cuda_graphs


@pytest.mark.parametrize("layout", [LAYOUT, BUCKETED], ids=["dynamic", "static"])
def test_the_attention_traces_as_one_graph_as_cuda_compiles_it(layout, monkeypatch):
    """CUDA compiles flex attention with fullgraph=True: the block mask and its mask_mod must
    trace without a graph break. Here through dynamo and AOT autograd (``aot_eager``: no
    Triton on this machine), on decode and verification steps, equal to the reference."""
    from cluster.models.layers import flex_paged

    chunks, tables = _steps()["three-decodes"]
    steps = [(chunks, tables), ([SeqChunk([8, 9, 10], 5, 3)], [[14, 27]])]
    for step_chunks, step_tables in steps:
        meta = prepare_inputs(step_chunks, step_tables, BLOCK, CPU, flex=layout).attn.flex
        q = torch.randn(sum(len(c.token_ids) for c in step_chunks), HEADS, HEAD_DIM)
        cache = torch.randn(2, NUM_BLOCKS * BLOCK, KV_HEADS, HEAD_DIM)
        reference = flex_paged.flex_paged_attention(q, cache, meta, 0.3)
        torch._dynamo.reset()
        compiled = flex_paged.compiled_flex(meta.static_shape, backend="aot_eager")
        monkeypatch.setattr(flex_paged, "_attend", lambda device_type, static_shape: compiled)
        torch.testing.assert_close(flex_paged.flex_paged_attention(q, cache, meta, 0.3), reference)
        monkeypatch.undo()
    torch._dynamo.reset()
