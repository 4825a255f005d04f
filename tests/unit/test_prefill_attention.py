"""The compiled prefill attention (cluster/kernels/prefill_attention.cpp) against float64 references,
beside torch's SDPA, and in the engine against transformers."""

from __future__ import annotations

import pytest
import torch

from cluster.kernels import build, prefill_choice
from cluster.models.layers.attention import PagedAttention
from cluster.quant.kv_int8 import Int8LayerCache
from cluster.runner.input_batch import SeqChunk, prepare_inputs
from cluster.shared.cpu_info import cpu_flags


@pytest.fixture(scope="module")
def kernel():
    module = build.prefill_attention()
    if module is None:
        assert "avx512f" not in cpu_flags().split() or not build.kernels_enabled(), \
            "prefill_attention did not build on this AVX-512 CPU"
        pytest.skip("prefill_attention needs AVX-512")
    return module


def _paged(query_lens, context_lens, num_kv_heads, head_dim, gen):
    """A bfloat16 cache holding every context, each sequence's slots scattered over it."""
    num_slots = sum(context_lens) + 37
    cache = torch.randn(2, num_slots, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    order = torch.randperm(num_slots, generator=gen)
    slots = torch.zeros(len(context_lens), max(context_lens), dtype=torch.int64)
    used = 0
    for s, context in enumerate(context_lens):
        slots[s, :context] = order[used:used + context]
        used += context
    return cache, slots, torch.tensor(query_lens), torch.tensor(context_lens)


def _reference(q, cache, slots, query_lens, context_lens, num_heads, scale):
    """Each sequence's rows over the keys up to their own positions, float64."""
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    group = num_heads // num_kv_heads
    out, first = [], 0
    for s in range(len(query_lens)):
        rows, context = int(query_lens[s]), int(context_lens[s])
        keys = cache[0, slots[s, :context]].double().repeat_interleave(group, dim=1)  # [context, heads, dim]
        values = cache[1, slots[s, :context]].double().repeat_interleave(group, dim=1)
        queries = q[first:first + rows].double().view(rows, num_heads, head_dim)
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        positions = context - rows + torch.arange(rows)
        scores = scores.masked_fill(torch.arange(context)[None, None, :] > positions[None, :, None], float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(rows, num_heads * head_dim))
        first += rows
    return torch.cat(out)


def _sdpa(q, cache, slots, query_lens, context_lens, num_heads, scale):
    """torch's SDPA in bfloat16, one sequence at a time, with the causal-after-prefix mask."""
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    out, first = [], 0
    for s in range(len(query_lens)):
        rows, context = int(query_lens[s]), int(context_lens[s])
        keys = cache[0, slots[s, :context]].view(1, context, num_kv_heads, head_dim).transpose(1, 2)
        values = cache[1, slots[s, :context]].view(1, context, num_kv_heads, head_dim).transpose(1, 2)
        queries = q[first:first + rows].view(1, rows, num_heads, head_dim).transpose(1, 2)
        positions = context - rows + torch.arange(rows)
        mask = (torch.arange(context)[None, :] <= positions[:, None]).view(1, 1, rows, context)
        o = torch.nn.functional.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale,
                                                             enable_gqa=num_heads != num_kv_heads)
        out.append(o.transpose(1, 2).reshape(rows, num_heads * head_dim))
        first += rows
    return torch.cat(out)


CASES = {
    "whole prompt, SmolLM2's heads": (9, 3, 64, [700], [700]),
    "chunk after a cached prefix": (9, 3, 64, [300], [1100]),
    "three sequences, no GQA, head_dim 128": (4, 4, 128, [100, 37, 200], [100, 300, 260]),
    "one-row and odd-length queries": (8, 2, 64, [1, 65, 17], [1, 129, 80]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rows_attend_causally_to_their_paged_context(kernel, case):
    num_heads, num_kv_heads, head_dim, query_lens, context_lens = CASES[case]
    gen = torch.Generator().manual_seed(0)
    cache, slots, qlens, clens = _paged(query_lens, context_lens, num_kv_heads, head_dim, gen)
    q = (2 * torch.randn(sum(query_lens), num_heads * head_dim, generator=gen)).to(torch.bfloat16)
    scale = head_dim ** -0.5
    out = kernel.paged_prefill_attention(q, cache, slots, qlens, clens, num_heads, scale)
    expected = _reference(q, cache, slots, qlens, clens, num_heads, scale)
    kernel_error = (out.double() - expected).abs().max().item()
    sdpa_error = (_sdpa(q, cache, slots, qlens, clens, num_heads, scale).double() - expected).abs().max().item()
    assert out.dtype == torch.bfloat16 and out.shape == expected.shape
    # bfloat16 outputs of size about 1-4: a rounding is up to 1/128 of the value; torch's SDPA errs as much.
    assert kernel_error < 2e-2, (kernel_error, sdpa_error)
    assert kernel_error <= 2 * sdpa_error + 4e-3, (kernel_error, sdpa_error)


def test_a_sequence_attends_the_same_alone_or_beside_others(kernel):
    gen = torch.Generator().manual_seed(1)
    cache, slots, qlens, clens = _paged([90, 150], [200, 150], 3, 64, gen)
    q = torch.randn(240, 9 * 64, generator=gen).to(torch.bfloat16)
    together = kernel.paged_prefill_attention(q, cache, slots, qlens, clens, 9, 0.125)
    alone = kernel.paged_prefill_attention(q[90:].contiguous(), cache, slots[1:].contiguous(), qlens[1:].contiguous(),
                                           clens[1:].contiguous(), 9, 0.125)
    assert torch.equal(together[90:], alone)


def _int8(cache):
    """The bfloat16 cache quantized as the engine's int8 cache, and that cache widened back."""
    layer = Int8LayerCache(torch.zeros(cache.shape, dtype=torch.int8), torch.zeros(cache.shape[:3]), torch.bfloat16)
    slots = torch.arange(cache.shape[1])
    layer.write(slots, cache[0], cache[1])
    return layer, torch.stack(layer.gather(slots))


@pytest.mark.parametrize("case", ["chunk after a cached prefix", "one-row and odd-length queries"])
def test_an_int8_cache_attends_exactly_as_its_widened_values(kernel, case):
    num_heads, num_kv_heads, head_dim, query_lens, context_lens = CASES[case]
    gen = torch.Generator().manual_seed(5)
    cache, slots, qlens, clens = _paged(query_lens, context_lens, num_kv_heads, head_dim, gen)
    int8, widened = _int8(cache)
    q = (2 * torch.randn(sum(query_lens), num_heads * head_dim, generator=gen)).to(torch.bfloat16)
    out = kernel.paged_prefill_attention(q, int8.values, slots, qlens, clens, num_heads, 0.125, int8.scales)
    assert torch.equal(out, kernel.paged_prefill_attention(q, widened, slots, qlens, clens, num_heads, 0.125))
    expected = _reference(q, widened, slots, qlens, clens, num_heads, 0.125)
    assert (out.double() - expected).abs().max().item() < 2e-2


def test_bad_input_is_refused_with_what_was_wrong(kernel):
    gen = torch.Generator().manual_seed(2)
    cache, slots, qlens, clens = _paged([10], [30], 3, 64, gen)
    q = torch.randn(10, 9 * 64, generator=gen).to(torch.bfloat16)
    bad = slots.clone()
    bad[0, 4] = 10_000
    with pytest.raises(RuntimeError, match="context slot out of range"):
        kernel.paged_prefill_attention(q, cache, bad, qlens, clens, 9, 0.125)
    with pytest.raises(RuntimeError, match="query lengths sum to 10"):
        kernel.paged_prefill_attention(q[:7], cache, slots, qlens, clens, 9, 0.125)
    with pytest.raises(RuntimeError, match="query length <= context length"):
        kernel.paged_prefill_attention(q, cache, slots, qlens, torch.tensor([5]), 9, 0.125)
    with pytest.raises(RuntimeError, match="bfloat16 or int8 CPU"):
        kernel.paged_prefill_attention(q.float(), cache.float(), slots, qlens, clens, 9, 0.125)
    with pytest.raises(RuntimeError, match="multiple of the KV heads"):
        kernel.paged_prefill_attention(q, cache, slots, qlens, clens, 8, 0.125)
    int8, _ = _int8(cache)
    with pytest.raises(RuntimeError, match="kv_scales go with an int8 kv_cache"):
        kernel.paged_prefill_attention(q, int8.values, slots, qlens, clens, 9, 0.125)
    with pytest.raises(RuntimeError, match="kv_scales go with an int8 kv_cache"):
        kernel.paged_prefill_attention(q, cache, slots, qlens, clens, 9, 0.125, int8.scales)
    with pytest.raises(RuntimeError, match="kv_scales must be contiguous float32"):
        kernel.paged_prefill_attention(q, int8.values, slots, qlens, clens, 9, 0.125, int8.scales[:, :5])


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_paged_attention_runs_prompts_in_the_kernel_beside_decodes(kernel, kv_dtype):
    """A step of two decodes, a prompt chunk after a cached prefix and a whole prompt: the long
    queries go to the kernel (counted), the result matches the SDPA path of the same module,
    on a bfloat16 cache and on an int8 one."""
    heads, kv_heads, head_dim, block = 9, 3, 64, 16
    chunks = [SeqChunk([5], 40, 1), SeqChunk(list(range(120)), 64, 1), SeqChunk([7], 9, 1),
              SeqChunk(list(range(300)), 0, 1)]
    tables, next_block = [], 0
    for chunk in chunks:
        num_blocks = -(-(chunk.start + len(chunk.token_ids)) // block)
        tables.append(list(range(next_block, next_block + num_blocks)))
        next_block += num_blocks
    meta = prepare_inputs(chunks, tables, block, torch.device("cpu")).attn
    gen = torch.Generator().manual_seed(3)
    tokens = sum(len(c.token_ids) for c in chunks)
    q = torch.randn(tokens, heads * head_dim, generator=gen).to(torch.bfloat16)
    k = torch.randn(tokens, kv_heads * head_dim, generator=gen).to(torch.bfloat16)
    v = torch.randn(tokens, kv_heads * head_dim, generator=gen).to(torch.bfloat16)
    cache = torch.randn(2, next_block * block, kv_heads, head_dim, generator=gen).to(torch.bfloat16)

    def fresh():
        if kv_dtype == "bfloat16":
            return cache.clone()
        int8, _ = _int8(cache)
        return int8

    layer = PagedAttention(heads, kv_heads, head_dim, head_dim ** -0.5)
    expected = layer(q, k, v, fresh(), meta)

    calls = []

    class Counting:
        def paged_prefill_attention(self, q, *args):
            calls.append(q.shape[0])
            return kernel.paged_prefill_attention(q, *args)

    layer.cpu_prefill = Counting()
    out = layer(q, k, v, fresh(), meta)
    assert calls == [420]  # the two long queries in one call; the decodes took the other part
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_the_probe_can_be_turned_off(kernel, monkeypatch):
    prefill_choice.prefill_kernel_for.cache_clear()
    monkeypatch.setenv("TANDEM_PREFILL_KERNEL", "0")
    try:
        assert prefill_choice.prefill_kernel_for(9, 3, 64) is None
    finally:
        prefill_choice.prefill_kernel_for.cache_clear()
    assert prefill_choice.prefill_kernel_for(9, 3, 48) is None  # head_dim the kernel does not take


def test_the_engine_prefills_in_the_kernel_as_close_to_transformers_as_sdpa(kernel, tmp_path):
    """A bfloat16 Llama with head_dim 64: prompt logprobs from the engine with the kernel and with
    SDPA, each against transformers' float32 forward over the same bfloat16 weights."""
    from transformers import AutoModelForCausalLM

    from cluster.engine.llm import LLM
    from cluster.models.tiny import save_tiny_model, save_tiny_tokenizer, tiny_llama_config
    from cluster.shared.sampling_params import SamplingParams

    config = tiny_llama_config(hidden_size=192, intermediate_size=256, num_attention_heads=3, num_key_value_heads=1)
    save_tiny_model(config, tmp_path, seed=0)
    save_tiny_tokenizer(tmp_path)
    prompt = torch.randint(3, 256, (150,), generator=torch.Generator().manual_seed(4)).tolist()
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).float().eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].double()
    expected = logits.log_softmax(-1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]

    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    llm = LLM(str(tmp_path), device="cpu", dtype="bfloat16", num_blocks=64, enable_prefix_caching=False)
    layers = [m for m in llm.engine.worker.runner.model.modules() if isinstance(m, PagedAttention)]
    calls = []

    class Counting:
        def paged_prefill_attention(self, *args):
            calls.append(1)
            return kernel.paged_prefill_attention(*args)

    errors = {}
    for name, attached in (("kernel", Counting()), ("sdpa", None)):
        for layer in layers:
            layer.cpu_prefill = attached
        out = llm.generate([prompt], params)[0]
        got = torch.tensor([entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], prompt[1:])],
                           dtype=torch.float64)
        errors[name] = (got - expected).abs().max().item()
    assert len(calls) == len(layers)  # one prefill step, every layer in the kernel
    assert errors["kernel"] <= 1.5 * errors["sdpa"] + 0.02, errors
