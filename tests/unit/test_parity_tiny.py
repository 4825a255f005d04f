"""Greedy outputs equal Hugging Face transformers' greedy generation, token for token."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster.engine.llm import LLM
from cluster.shared.sampling_params import SamplingParams

MAX_TOKENS = 24


def _prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 17, 41, 3, 64)]


def _hf_greedy(path, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # Our ignore_eos keeps EOS sampleable; HF's min_new_tokens would ban it. So: no EOS at all.
    model.generation_config.eos_token_id = None
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                             do_sample=False, pad_token_id=0)
        outs.append(gen[0, len(p):].tolist())
        assert len(outs[-1]) == MAX_TOKENS
    return outs


def _tandem_greedy(path, prompts, **overrides) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), device="cpu", dtype="float32", **overrides)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    llm.engine.check_invariants()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.pool.num_blocks
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.fixture(scope="module", params=["llama", "opt", "qwen2"])
def model_and_reference(request, tiny_llama_dir, tiny_opt_dir, tiny_qwen2_dir):
    path = {"llama": tiny_llama_dir, "opt": tiny_opt_dir, "qwen2": tiny_qwen2_dir}[request.param]
    prompts = _prompts()
    return path, prompts, _hf_greedy(path, prompts)


def test_batched_greedy_matches_transformers(model_and_reference):
    path, prompts, expected = model_and_reference
    got, _ = _tandem_greedy(path, prompts, num_blocks=128)
    assert got == expected


def test_preemption_keeps_outputs(model_and_reference):
    path, prompts, expected = model_and_reference
    # 5 prompts of up to 64 + 24 tokens in 16 blocks of 16 tokens: not all fit at once.
    got, llm = _tandem_greedy(path, prompts, num_blocks=16, block_size=16)
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == expected


def test_chunked_prefill_keeps_outputs(model_and_reference):
    path, prompts, expected = model_and_reference
    got, _ = _tandem_greedy(path, prompts, num_blocks=128, max_num_batched_tokens=7)
    assert got == expected


def test_small_blocks_and_few_seqs(model_and_reference):
    path, prompts, expected = model_and_reference
    got, _ = _tandem_greedy(path, prompts, num_blocks=256, block_size=4, max_num_seqs=2)
    assert got == expected


def test_prompts_arriving_while_others_decode_keep_outputs(model_and_reference):
    """Prompts prefilled in the same steps as other requests' decodes (the two-part attention of
    a mixed step) still give transformers' tokens."""
    path, prompts, expected = model_and_reference
    llm = LLM(str(path), device="cpu", dtype="float32", num_blocks=128)
    engine = llm.engine
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    ids, got, mixed_steps = [], {}, 0  # request id -> its whole output so far
    for prompt in prompts:
        ids.append(engine.add_request(prompt, params))
        for _ in range(3):
            got.update({out.request_id: out.outputs[0].token_ids for out in engine.step()})
            step = engine.last_step
            mixed_steps += step.num_prefill_tokens > 16 and step.num_seqs > 1
    while engine.has_unfinished():
        got.update({out.request_id: out.outputs[0].token_ids for out in engine.step()})
    assert mixed_steps >= 2  # the 17-, 41- and 64-token prompts joined running decodes
    assert [got[i] for i in ids] == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.pool.num_blocks


def test_logit_bias_matches_transformers_sequence_bias(tiny_llama_dir):
    """Greedy with OpenAI's logit_bias equals transformers' greedy with the same one-token
    sequence_bias, under n-gram speculation (which a biased request does without)."""
    prompts = _prompts(seed=3)[:3]
    plain = _hf_greedy(tiny_llama_dir, prompts)
    # Push away the first greedy token of each output and pull up another one.
    bias = {plain[0][0]: -100.0, plain[1][0]: -100.0, 17: 4.0, 200: -7.5}
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    expected = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                             pad_token_id=0, sequence_bias={(t,): v for t, v in bias.items()})
        expected.append(gen[0, len(p):].tolist())
    assert expected[0][0] != plain[0][0]
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_blocks=128, method="ngram",
              num_speculative_tokens=3)
    unbiased = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, unbiased)] == plain
    drafted = llm.engine.spec_stats.num_draft_tokens
    assert drafted > 0  # these prompts do get n-gram drafts
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logit_bias=bias)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    assert llm.engine.spec_stats.num_draft_tokens == drafted  # none for the biased requests


def test_allowed_token_ids_match_transformers_suppressing_the_rest(tiny_llama_dir):
    """Greedy with vLLM's allowed_token_ids equals transformers' greedy with every other id in
    suppress_tokens; such requests decode without drafts."""
    prompts = _prompts(seed=5)[:3]
    allowed = list(range(40, 90)) + [7, 250]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    suppressed = [t for t in range(model.config.vocab_size) if t not in allowed]
    expected = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                             pad_token_id=0, suppress_tokens=suppressed)
        expected.append(gen[0, len(p):].tolist())
    assert all(set(e) <= set(allowed) for e in expected)
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_blocks=128, method="ngram",
              num_speculative_tokens=3)
    llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    drafted = llm.engine.spec_stats.num_draft_tokens
    assert drafted > 0  # unrestricted, these prompts get n-gram drafts
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, allowed_token_ids=allowed)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.spec_stats.num_draft_tokens == drafted


# Logprobs closer than this are a tie: float32 kernels that sum in another order may rank them either way.
RANK_TIE = 1e-5


def _hf_prompt_logprobs(path, prompt: list[int], num: int) -> list[tuple[float, range, list[int]]]:
    """Per prompt token after the first: its logprob given the tokens before it, the ranks it may
    have (one, but for other tokens within ``RANK_TIE`` of it), the top ``num``."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = model(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)
    expected = []
    for position in range(1, len(prompt)):
        row = logprobs[position - 1]
        value = row[prompt[position]]
        ranks = range(int((row > value + RANK_TIE).sum()) + 1, int((row > value - RANK_TIE).sum()) + 1)
        expected.append((value.item(), ranks, row.topk(num).indices.tolist()))
    return expected


@pytest.mark.parametrize("overrides", [
    dict(num_blocks=128),
    dict(num_blocks=128, max_num_batched_tokens=7),  # each prompt in chunks of at most 7 tokens
    dict(num_blocks=16, block_size=16),  # preemptions: the prompt is recomputed
], ids=["whole", "chunked", "preempted"])
def test_prompt_logprobs_match_transformers(model_and_reference, overrides):
    """prompt_logprobs: None for the first token, then each prompt token's logprob given the
    ones before it, its rank and the top-n, as transformers' log-softmax of the same model gives
    them; the same prompt sent twice runs its whole prompt again instead of reading the prefix
    cache (its logits are needed), and the outputs are unchanged."""
    path, prompts, expected_outputs = model_and_reference
    num = 3
    llm = LLM(str(path), device="cpu", dtype="float32", enable_prefix_caching=True, **overrides)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, prompt_logprobs=num)
    outs = llm.generate(prompts, params)
    outs += llm.generate([prompts[2]], params)  # its blocks are in the prefix cache now
    if overrides.get("num_blocks") == 16:
        assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected_outputs + [expected_outputs[2]]
    assert outs[-1].usage.cached_tokens == 0  # the repeated prompt was not read from the cache
    for prompt, out in zip(prompts + [prompts[2]], outs):
        got = out.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        for position, (value, ranks, top) in enumerate(_hf_prompt_logprobs(path, prompt, num), start=1):
            entry = got[position]
            token = prompt[position]
            assert next(iter(entry)) == token  # the prompt's own token first
            assert entry[token].logprob == pytest.approx(value, abs=1e-4)
            assert entry[token].rank in ranks
            assert set(entry) == {token, *top}
            assert [entry[t].rank for t in top if t != token] == [top.index(t) + 1 for t in top if t != token]
    llm.engine.check_invariants()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.pool.num_blocks
