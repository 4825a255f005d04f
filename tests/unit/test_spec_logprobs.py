"""Requests that ask for logprobs keep speculation, and get what plain decoding gives.

A speculative step returns, for every token it emits (accepted drafts, then the recovered or
bonus token), the logprob of that token under the target's raw distribution at its position, its
rank and the top-n (``ModelRunner._verify``). References: the same request decoded without
speculation (greedy, and seeded sampling under coupled verification, give the same tokens), and,
for rejection sampling (whose tokens differ), Hugging Face ``transformers``' own log-softmax of
the target at each position. Float32 tiny models; n-gram drafts on prompts that repeat, and every
test checks that drafts were accepted.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster.shared.sampling_params import SamplingParams
from tests.engine_helpers import make_engine

PROMPT = [5, 6, 7, 8, 9] * 4  # repeats, so n-gram lookup finds drafts
PLAIN = dict(method="none")
NGRAM = dict(method="ngram", num_speculative_tokens=4, ngram_draft_per_match_token=None)
ATOL = 1e-5


def _generate(model_dir, prompts, params, num_blocks=128, **overrides):
    """Per request: its output (tokens, logprobs, per-step deltas, prompt logprobs); and the engine."""
    engine = make_engine(model_dir, num_blocks=num_blocks, block_size=4, **overrides)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    deltas, done = {i: [] for i in ids}, {}
    while engine.has_unfinished():
        for out in engine.step():
            deltas[out.request_id].append(out.outputs[0].delta_token_ids)
            if out.finished:
                done[out.request_id] = out
        engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.pool.num_blocks
    return [(done[i].outputs[0].token_ids, done[i].outputs[0].logprobs, deltas[i], done[i].prompt_logprobs)
            for i in ids], engine


def _assert_same_logprobs(got, want):
    """Same positions, the same ids in the same order with the same ranks, values within ATOL."""
    assert len(got) == len(want)
    for position, (g, w) in enumerate(zip(got, want)):
        assert list(g) == list(w), f"position {position}: ids {list(g)} != {list(w)}"
        assert [e.rank for e in g.values()] == [e.rank for e in w.values()], f"position {position}"
        values = torch.tensor([e.logprob for e in g.values()], dtype=torch.float64)
        expected = torch.tensor([e.logprob for e in w.values()], dtype=torch.float64)
        torch.testing.assert_close(values, expected, atol=ATOL, rtol=0, msg=f"position {position}")


def _accepted(engine) -> int:
    return engine.stats().spec.num_accepted_tokens


@pytest.mark.parametrize("num_logprobs", [0, 5])
def test_greedy_logprobs_equal_plain_decoding(tiny_llama_dir, num_logprobs):
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=num_logprobs)]
    [plain], _ = _generate(tiny_llama_dir, [PROMPT], params, **PLAIN)
    spec, engine = _generate(tiny_llama_dir, [PROMPT], params, **NGRAM)
    tokens, logprobs, deltas, _ = spec[0]
    assert _accepted(engine) > 0 and max(len(d) for d in deltas) > 1, "no draft was accepted"
    assert tokens == plain[0]
    assert len(logprobs) == len(tokens)
    assert all(len(entry) <= num_logprobs + 1 and token in entry for token, entry in zip(tokens, logprobs))
    _assert_same_logprobs(logprobs, plain[1])


@pytest.mark.parametrize("proposer", ["ngram", "noisy-draft"])
def test_seeded_coupled_logprobs_equal_plain_decoding(tiny_llama_dir, noisy_draft_dir, proposer):
    """Coupled verification emits plain decoding's tokens; their logprobs are plain decoding's too."""
    settings = NGRAM if proposer == "ngram" else dict(method="draft", draft_model=str(noisy_draft_dir),
                                                     num_speculative_tokens=3)
    # a low temperature, so that the tiny model's text repeats and n-gram drafts are accepted
    params = [SamplingParams(max_tokens=40, temperature=0.3, top_p=0.9, seed=2, ignore_eos=True, logprobs=3)]
    [plain], _ = _generate(tiny_llama_dir, [PROMPT], params, **{**settings, "num_speculative_tokens": 0})
    spec, engine = _generate(tiny_llama_dir, [PROMPT], params, **settings)
    assert _accepted(engine) > 0, "no draft was accepted"
    assert spec[0][0] == plain[0]
    _assert_same_logprobs(spec[0][1], plain[1])


def test_a_mixed_batch_keeps_each_requests_logprobs(tiny_llama_dir):
    """Greedy and seeded requests with different top-n, one without logprobs and one unseeded (so the
    batch verifies by coupling and rejection sampling together): each compared request gets plain
    decoding's tokens and logprobs."""
    prompts = [PROMPT, [3, 4] * 8, PROMPT[3:], [11, 12, 13] * 5, [7, 8] * 6]
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=24, temperature=0.9, seed=7, ignore_eos=True, logprobs=0),
              SamplingParams(max_tokens=36, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=28, temperature=1.0, top_k=20, seed=99, ignore_eos=True, logprobs=6,
                             prompt_logprobs=2),
              SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True, logprobs=1)]
    plain, _ = _generate(tiny_llama_dir, prompts, params, **PLAIN)
    spec, engine = _generate(tiny_llama_dir, prompts, params, **NGRAM)
    assert any(max(len(d) for d in spec[i][2]) > 1 for i in (0, 1, 3)), "no request with logprobs accepted a draft"
    for i in (0, 1, 2, 3):
        assert spec[i][0] == plain[i][0], f"request {i}"
        if params[i].logprobs is None:
            assert spec[i][1] is None
        else:
            _assert_same_logprobs(spec[i][1], plain[i][1])
    # prompt logprobs: computed by the prefill, as without speculation
    assert spec[3][3][0] is None and len(spec[3][3]) == len(prompts[3])
    _assert_same_logprobs(spec[3][3][1:], plain[3][3][1:])
    assert len(spec[4][1]) == len(spec[4][0])  # the unseeded one: a logprob per token


def test_a_stop_inside_accepted_drafts_cuts_the_logprobs(tiny_llama_dir, noisy_draft_dir):
    """A stop token inside a run of accepted drafts ends the output there; its logprobs end with it.
    (A draft model: n-gram drafts copy the context, so a token new to the output comes as a bonus.)"""
    prompt, settings = [3, 4] * 8, dict(method="draft", draft_model=str(noisy_draft_dir), num_speculative_tokens=3)
    base = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=1)
    free, _ = _generate(tiny_llama_dir, [prompt], [base], **settings)
    tokens, _, deltas, _ = free[0]
    # the first token that appears for the first time inside a multi-token step, before its last token
    stop, seen = None, set()
    for delta in deltas:
        for j, token in enumerate(delta):
            if stop is None and token not in seen and j < len(delta) - 1:
                stop = token
            seen.add(token)
    assert stop is not None, "no step emitted a run of accepted drafts"
    params = [dataclasses.replace(base, stop_token_ids=[stop])]
    [plain], _ = _generate(tiny_llama_dir, [prompt], params, **PLAIN)
    spec, _ = _generate(tiny_llama_dir, [prompt], params, **settings)
    assert spec[0][0] == plain[0] and spec[0][0][-1] == stop and len(spec[0][0]) < len(tokens)
    _assert_same_logprobs(spec[0][1], plain[1])


def test_rejection_sampling_logprobs_are_the_targets(tiny_llama_dir):
    """Rejection sampling's tokens are its own; each one's logprob, rank and top-n are the target's raw
    log-softmax at its position, as ``transformers`` computes it (not the tempered, top-p-cut one)."""
    num_logprobs = 4
    params = [SamplingParams(max_tokens=40, temperature=0.7, top_p=0.8, seed=3, ignore_eos=True,
                             logprobs=num_logprobs),
              SamplingParams(max_tokens=32, temperature=1.0, seed=5, ignore_eos=True, logprobs=num_logprobs)]
    prompts = [PROMPT, PROMPT[1:]]
    spec, engine = _generate(tiny_llama_dir, prompts, params, verification="rejection", **NGRAM)
    assert _accepted(engine) > 0, "no draft was accepted"
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for prompt, (tokens, logprobs, _, _) in zip(prompts, spec):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        reference = logits.double().log_softmax(dim=-1)  # [len(tokens), vocab]
        assert len(logprobs) == len(tokens)
        for t, (token, entry) in enumerate(zip(tokens, logprobs)):
            row = reference[t]
            top = row.topk(num_logprobs).indices.tolist()
            assert list(entry)[0] == token  # the emitted token first, then the top-n
            assert set(entry) == set(top) | {token}, f"position {t}"
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            assert [entry[i].rank for i in top if i != token] == [n + 1 for n, i in enumerate(top) if i != token]
            for i in entry:
                assert abs(entry[i].logprob - row[i].item()) < 1e-4, f"position {t}, token {i}"
