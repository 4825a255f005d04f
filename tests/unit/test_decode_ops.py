"""The compiled decode-step ops (cluster/kernels/decode_ops.cpp) against float64 references."""

from __future__ import annotations

import pytest
import torch

from cluster.kernels import build
from cluster.models.layers.rotary import apply_rotary


@pytest.fixture(scope="module")
def ops():
    module = build.decode_ops()
    if module is None:
        assert not build.cpu_has_vectors() or not build.kernels_enabled(), "decode_ops did not build on this CPU"
        pytest.skip("decode_ops is not available on this CPU")
    return module


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rounds_like_transformers_llama(ops, dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 576, generator=gen).to(dtype)
    weight = torch.randn(576, generator=gen).to(dtype)
    # LlamaRMSNorm: float32 inside, rounded to the input dtype before the weight.
    xf = x.float()
    expected = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype) * weight
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), expected, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_adds_the_residual_in_the_dtype_then_normalizes(ops, dtype):
    gen = torch.Generator().manual_seed(9)
    x, residual = (torch.randn(5, 576, generator=gen).to(dtype) for _ in range(2))
    weight = torch.randn(576, generator=gen).to(dtype)
    total, normed = ops.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, x + residual)  # torch's rounding of the add
    assert torch.equal(normed, ops.rms_norm(x + residual, weight, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1536, 1000])  # a whole number of vectors, and a scalar tail
def test_silu_and_mul_matches_torch(ops, dtype, n):
    gen = torch.Generator().manual_seed(10)
    gate_up = (torch.randn(6, 2 * n, generator=gen) * 6).to(dtype)
    gate_up[0, :6] = torch.tensor([-200.0, 200.0, 0.0, -0.0, 1e-4, -90.0])  # exp(-x) would overflow float32
    gate, up = gate_up.chunk(2, dim=-1)
    out = ops.silu_and_mul(gate_up)
    assert out.shape == (6, n) and torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, rtol=TOL[dtype], atol=1e-5)


def _paged_batch(dtype, gen, num_slots=300, num_heads=6, num_kv_heads=2, head_dim=32, lens=(1, 19, 64)):
    """Sequences of the given lengths on shuffled slots; the last slot of each is its new token."""
    lens = torch.tensor(lens)
    num_slots = max(num_slots, int(lens.sum()) + 16)
    perm = torch.randperm(num_slots, generator=gen)
    context_slots = torch.zeros(len(lens), int(lens.max()), dtype=torch.int64)
    start = 0
    for s, n in enumerate(lens.tolist()):
        context_slots[s, :n] = perm[start : start + n]
        start += n
    slot_mapping = torch.stack([context_slots[s, lens[s] - 1] for s in range(len(lens))])
    cache = torch.randn(2, num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    return lens, context_slots, slot_mapping, cache


def _reference(q, k, v, cache, slot_mapping, context_slots, lens, num_heads, scale):
    """Write, then float64 softmax attention per sequence with GQA."""
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    cache = cache.clone()
    cache[0, slot_mapping] = k.view(-1, num_kv_heads, head_dim).to(cache.dtype)
    cache[1, slot_mapping] = v.view(-1, num_kv_heads, head_dim).to(cache.dtype)
    out = []
    for s in range(len(lens)):
        keys = cache[0, context_slots[s, : lens[s]]].double().transpose(0, 1)  # [kv_heads, len, head_dim]
        values = cache[1, context_slots[s, : lens[s]]].double().transpose(0, 1)
        query = q[s].double().view(num_kv_heads, num_heads // num_kv_heads, head_dim)
        probs = torch.softmax(query @ keys.transpose(1, 2) * scale, dim=-1)
        out.append((probs @ values).reshape(-1))
    return torch.stack(out), cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_attention_writes_then_attends_through_the_slot_table(ops, dtype):
    gen = torch.Generator().manual_seed(1)
    lens, context_slots, slot_mapping, cache = _paged_batch(dtype, gen)
    q = torch.randn(3, 6 * 32, generator=gen).to(dtype)
    k, v = (torch.randn(3, 2 * 32, generator=gen).to(dtype) for _ in range(2))
    expected, expected_cache = _reference(q, k, v, cache, slot_mapping, context_slots, lens, 6, 0.2)
    out = ops.paged_decode_attention(q, k, v, cache, slot_mapping, context_slots, lens, 6, 0.2)
    assert torch.equal(cache, expected_cache)  # the new K/V landed in their slots, nothing else moved
    torch.testing.assert_close(out.double(), expected, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_decode_attention_equals_rotary_then_attention(ops, dtype):
    gen = torch.Generator().manual_seed(2)
    lens, context_slots, slot_mapping, cache = _paged_batch(dtype, gen)
    qkv = torch.randn(3, (6 + 2 * 2) * 32, generator=gen).to(dtype)
    angles = torch.rand(3, 1, 16, generator=gen) * 3
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin_signed = torch.cat([-angles.sin(), angles.sin()], -1).to(dtype)
    qk = apply_rotary(qkv[:, : 8 * 32].double().view(3, 8, 32), cos.double(), sin_signed.double())
    q, k, v = qk[:, :6].reshape(3, -1), qk[:, 6:].reshape(3, -1), qkv[:, 8 * 32 :]
    expected, expected_cache = _reference(q, k, v, cache, slot_mapping, context_slots, lens, 6, 0.2)
    out = ops.rotary_decode_attention(qkv, cos, sin_signed, cache, slot_mapping, context_slots, lens, 6, 0.2)
    torch.testing.assert_close(cache, expected_cache, rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(out.double(), expected, rtol=TOL[dtype], atol=TOL[dtype])


# (query heads, KV heads, head_dim): every register tile the kernel picks (1, 2, 3, 4 or 8 query heads,
# groups of 1 to 16 heads, 1 to 4 vectors of a head), and contexts of several 256-slot chunks with a
# partial last one.
SHAPES = [(6, 2, 32), (8, 8, 64), (4, 2, 64), (12, 2, 64), (16, 4, 64), (8, 1, 128), (14, 2, 64), (16, 1, 48),
          (10, 2, 16 * 5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", SHAPES)
def test_decode_attention_over_long_contexts_and_every_head_shape(ops, dtype, num_heads, num_kv_heads, head_dim):
    if head_dim % ops.head_dim_multiple:
        pytest.skip(f"head_dim {head_dim} is not a multiple of this CPU's {ops.head_dim_multiple} lanes")
    gen = torch.Generator().manual_seed(7)
    lens, context_slots, slot_mapping, cache = _paged_batch(dtype, gen, num_heads=num_heads,
                                                            num_kv_heads=num_kv_heads, head_dim=head_dim,
                                                            lens=(700, 3, 256, 257, 40))
    cache[0] *= 3  # scores spread over a wider range than unit-variance keys give
    q = torch.randn(len(lens), num_heads * head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(len(lens), num_kv_heads * head_dim, generator=gen).to(dtype) for _ in range(2))
    expected, _ = _reference(q, k, v, cache, slot_mapping, context_slots, lens, num_heads, head_dim**-0.5)
    out = ops.paged_decode_attention(q, k, v, cache, slot_mapping, context_slots, lens, num_heads, head_dim**-0.5)
    torch.testing.assert_close(out.double(), expected, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_attends_the_same_alone_or_beside_others(ops, dtype):
    """A row's result depends on its own context only: bit for bit the same in a call of one row
    and beside rows of other lengths (what keeps verification equal to plain decoding). Alone, a
    row of 128-255 keys is attended with its KV heads split over the threads."""
    gen = torch.Generator().manual_seed(8)
    lens, context_slots, slot_mapping, cache = _paged_batch(dtype, gen, lens=(600, 5, 300, 70, 200))
    q = torch.randn(len(lens), 6 * 32, generator=gen).to(dtype)
    k, v = (torch.randn(len(lens), 2 * 32, generator=gen).to(dtype) for _ in range(2))
    together = ops.paged_decode_attention(q, k, v, cache.clone(), slot_mapping, context_slots, lens, 6, 0.2)
    for s in range(len(lens)):
        alone = ops.paged_decode_attention(q[s : s + 1], k[s : s + 1], v[s : s + 1], cache.clone(),
                                           slot_mapping[s : s + 1], context_slots[s : s + 1].contiguous(),
                                           lens[s : s + 1], 6, 0.2)
        assert torch.equal(alone[0], together[s])


def test_bad_indices_are_refused_before_anything_is_written(ops):
    gen = torch.Generator().manual_seed(3)
    lens, context_slots, slot_mapping, cache = _paged_batch(torch.float32, gen)
    q, k, v = torch.randn(3, 192), torch.randn(3, 64), torch.randn(3, 64)
    before = cache.clone()
    bad = context_slots.clone()
    bad[2, 5] = 10_000
    with pytest.raises(RuntimeError, match="context slot out of range"):
        ops.paged_decode_attention(q, k, v, cache, slot_mapping, bad, lens, 6, 0.2)
    with pytest.raises(RuntimeError, match="context length out of range"):
        ops.paged_decode_attention(q, k, v, cache, slot_mapping, context_slots, lens + 64, 6, 0.2)
    with pytest.raises(RuntimeError, match="rows of the cache's dtype"):
        ops.paged_decode_attention(q.double(), k, v, cache, slot_mapping, context_slots, lens, 6, 0.2)
    assert torch.equal(cache, before)


def _transformers_greedy(model_dir, prompt_len: int, seed: int, new_tokens: int) -> tuple[list[int], list[int]]:
    """A random prompt of the tiny Llama's vocabulary and transformers' greedy continuation of it."""
    from transformers import AutoModelForCausalLM

    prompt = torch.randint(3, 256, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                      pad_token_id=0)
    return prompt, out[0, prompt_len:].tolist()


def test_the_engine_decodes_in_the_kernels_and_keeps_transformers_outputs(ops, tiny_llama_dir):
    """Short-query steps of a tiny Llama go through the compiled ops (counted), and greedy output
    still equals transformers' greedy generation token for token."""
    from cluster.engine.llm import LLM
    from cluster.shared.sampling_params import SamplingParams

    prompt, expected = _transformers_greedy(tiny_llama_dir, 11, 4, 16)
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_blocks=64)
    model = llm.engine.worker.runner.model
    calls = {"attention": 0, "norm": 0, "add_norm": 0, "act": 0}

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def rotary_decode_attention(self, *args):
            calls["attention"] += 1
            return self.inner.rotary_decode_attention(*args)

        def rms_norm(self, *args):
            calls["norm"] += 1
            return self.inner.rms_norm(*args)

        def add_rms_norm(self, *args):
            calls["add_norm"] += 1
            return self.inner.add_rms_norm(*args)

        def silu_and_mul(self, *args):
            calls["act"] += 1
            return self.inner.silu_and_mul(*args)

    for module in model.modules():
        if getattr(module, "cpu_ops", None) is not None:
            module.cpu_ops = Counting(module.cpu_ops)
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == expected
    num_layers = model.num_layers
    assert calls["attention"] == 16 * num_layers  # the 11-token prefill (a short query) and 15 decode steps
    # prefill and decode steps alike: the first layer's input norm alone, every other norm (each
    # layer's post-attention one, the later layers' input ones, the final one) with the residual add
    assert calls["norm"] == 16
    assert calls["add_norm"] == 16 * 2 * num_layers
    assert calls["act"] == 16 * num_layers


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_verification_rows_get_the_logits_of_plain_decoding_bit_for_bit(ops, tiny_llama_dir, dtype, kv_cache_dtype):
    """Scoring k+1 tokens in one pass gives exactly the logits of decoding them one at a time,
    so speculation cannot flip a near-tie that plain greedy decoding would have taken the
    other way (SDPA over the gathered context, the path before, rounds differently). An int8
    KV cache too: its rows are read by the same kernel."""
    from cluster.engine.llm import LLM
    from cluster.runner.input_batch import SeqChunk

    llm = LLM(str(tiny_llama_dir), device="cpu", dtype=dtype, num_blocks=64, block_size=4,
              kv_cache_dtype=kv_cache_dtype)
    runner = llm.engine.worker.runner
    gen = torch.Generator().manual_seed(6)
    prompt = torch.randint(3, 256, (13,), generator=gen).tolist()
    tokens = torch.randint(3, 256, (5,), generator=gen).tolist()  # a token and four drafts
    one_by_one, together = list(range(0, 8)), list(range(8, 16))  # block tables in separate blocks
    runner.forward_logits([SeqChunk(prompt, 0, 1)], [one_by_one])
    decoded = torch.cat([runner.forward_logits([SeqChunk([t], len(prompt) + i, 1)], [one_by_one])
                         for i, t in enumerate(tokens)])
    runner.forward_logits([SeqChunk(prompt, 0, 1)], [together])
    verified = runner.forward_logits([SeqChunk(tokens, len(prompt), len(tokens))], [together])
    assert torch.equal(verified, decoded)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculation_at_batch_1_keeps_greedy_output_bit_for_bit(ops, tiny_llama_dir, dtype):
    """Verification rows get the decode kernels' arithmetic, so even in bfloat16 (where a
    different kernel's rounding flips near-ties of a random model) n-gram speculation
    reproduces plain greedy decoding exactly."""
    from cluster.engine.llm import LLM
    from cluster.shared.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(5)
    phrase = torch.randint(3, 256, (6,), generator=gen).tolist()
    prompts = [phrase * 4 + torch.randint(3, 256, (n,), generator=gen).tolist() for n in (1, 4, 9)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    outputs = {}
    for k in (0, 4):
        spec = {} if k == 0 else {"method": "ngram", "num_speculative_tokens": k}
        llm = LLM(str(tiny_llama_dir), device="cpu", dtype=dtype, num_blocks=64, max_num_seqs=1, **spec)
        outputs[k] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    drafted = llm.engine.stats().spec
    assert drafted.num_draft_tokens > 0  # verification steps did happen
    assert outputs[4] == outputs[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 32, 40])  # 40: half a head is a vector and a scalar tail
def test_rotary_gives_torchs_values_bit_for_bit(ops, dtype, head_dim):
    gen = torch.Generator().manual_seed(11)
    rows, heads, kv_heads = 37, 9, 3
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen) * 4).to(dtype)
    x = qkv[:, : (heads + kv_heads) * head_dim].view(rows, -1, head_dim)  # Q and K heads, rows qkv's stride apart
    angles = torch.rand(rows, 1, head_dim // 2, generator=gen) * 50
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin_signed = torch.cat([-angles.sin(), angles.sin()], -1).to(dtype)
    out = ops.rotary(x, cos, sin_signed)
    assert out.shape == x.shape and out.is_contiguous()
    assert torch.equal(out, apply_rotary(x, cos, sin_signed))  # torch's three ops, each rounded to dtype
    assert torch.equal(apply_rotary(x, cos, sin_signed, cpu_ops=ops), out)
    assert ops.rotary(x[:0], cos[:0], sin_signed[:0]).shape == (0, heads + kv_heads, head_dim)


def test_rotary_refuses_what_it_cannot_read(ops):
    x = torch.randn(4, 3, 32).bfloat16()
    cos = sin = torch.randn(4, 1, 32).bfloat16()
    with pytest.raises(RuntimeError, match="cos and sin must be"):
        ops.rotary(x, cos.float(), sin)
    with pytest.raises(RuntimeError, match="cos and sin must be"):
        ops.rotary(x, cos[:2], sin)
    with pytest.raises(RuntimeError, match="rows of x overlap"):
        ops.rotary(x.transpose(0, 1), cos[:3], sin[:3])
    with pytest.raises(RuntimeError, match="heads must be contiguous"):
        ops.rotary(x[..., ::2], cos[..., :16].contiguous(), sin[..., :16].contiguous())
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.rotary(x.double(), cos.double(), sin.double())


def test_prompt_steps_rotate_in_the_compiled_op_and_keep_transformers_outputs(ops, tiny_llama_dir):
    """A prompt longer than a short query rotates Q and K in one compiled call per layer, and greedy
    output still equals transformers' greedy generation token for token."""
    from cluster.engine.llm import LLM
    from cluster.shared.sampling_params import SamplingParams

    prompt, expected = _transformers_greedy(tiny_llama_dir, 40, 5, 8)
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_blocks=64)
    model = llm.engine.worker.runner.model
    calls = []

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def rotary(self, *args):
            calls.append(args[0].shape[0])
            return self.inner.rotary(*args)

    for module in model.modules():
        if getattr(module, "cpu_ops", None) is not None:
            module.cpu_ops = Counting(module.cpu_ops)
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == expected
    assert calls == [40] * model.num_layers  # the prompt's step only: decode steps rotate inside the attention
