"""Structured outputs inside the engine: outputs match their grammar, with and without
speculation, in mixed batches, under preemption and prefix caching; the speculative path
samples exactly the masked target distribution; grammar dead ends end clearly.

Tiny random-weight Llamas with the character-level test tokenizer: the grammar, not the
model, makes the structure, so any leak in the masks shows.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster.shared.sampling_params import SamplingParams
from cluster.models.tiny import save_tiny_model, save_tiny_tokenizer, tiny_llama_config
from cluster.structured.constraint import StructuredOutputs
from tests.engine_helpers import make_engine, run_to_completion
from tests.goodness_of_fit import chi2_quantile, chi2_statistic

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["id", "kind", "tags"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{2}-[a-f]{1,3}"
CHOICES = ("alpha", "beta", "gamma")


def _speculation(method: str, draft_dir, head_dir=None) -> dict:
    if method == "none":
        return {}
    extra = {"ngram": {"ngram_min": 1}, "suffix": {}, "draft": {"draft_model": str(draft_dir)},
             "eagle3": {"draft_model": str(head_dir)}}[method]
    return dict(method=method, num_speculative_tokens=3, controller="fixed", **extra)


def _check(text: str, constraint: StructuredOutputs) -> None:
    if constraint.json is not None:
        jsonschema.validate(json.loads(text), constraint.json)
    elif constraint.regex is not None:
        assert re.fullmatch(constraint.regex, text), text
    else:
        assert text in constraint.choice, text


def _finish_all(engine) -> dict:
    """Step until done (invariants after every step, every block free at the end): final outputs by id."""
    results = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0]
        engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.pool.num_blocks
    return results


CONSTRAINTS = [StructuredOutputs(json=SCHEMA), StructuredOutputs(regex=REGEX), StructuredOutputs(choice=CHOICES)]


@pytest.mark.parametrize("method", ["none", "ngram", "suffix", "draft", "eagle3"])
def test_outputs_match_their_grammar_beside_free_requests(tiny_llama_dir, noisy_draft_dir, tiny_head_dir, method):
    engine = make_engine(tiny_llama_dir, **_speculation(method, noisy_draft_dir, tiny_head_dir))
    prompts, params = [], []
    for seed in range(4):
        for constraint in CONSTRAINTS:
            prompts.append(f"item {seed}: ")
            params.append(SamplingParams(max_tokens=80, temperature=1.0, seed=seed, structured_outputs=constraint))
    prompts.append("free text ")
    params.append(SamplingParams(max_tokens=24, temperature=0))
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    results = _finish_all(engine)
    for rid, sp in zip(ids[:-1], params[:-1]):
        assert results[rid].finish_reason == "stop", results[rid]
        _check(results[rid].text, sp.structured_outputs)
    # The unconstrained partner is untouched by its neighbours' masks.
    alone = run_to_completion(make_engine(tiny_llama_dir), ["free text "], params[-1])[0]
    assert results[ids[-1]].token_ids == alone
    if method != "none":
        assert engine.stats().spec.num_draft_tokens > 0


def test_greedy_outputs_equal_with_and_without_speculation(tiny_llama_dir, noisy_draft_dir, tiny_head_dir):
    prompts = [f"record {i}: " for i in range(3)]
    params = [SamplingParams(max_tokens=80, temperature=0, structured_outputs=c) for c in CONSTRAINTS]
    outputs = {m: run_to_completion(make_engine(tiny_llama_dir, **_speculation(m, noisy_draft_dir, tiny_head_dir)),
                                    prompts, params)
               for m in ("none", "ngram", "draft", "eagle3")}
    assert outputs["ngram"] == outputs["none"]
    assert outputs["draft"] == outputs["none"]
    assert outputs["eagle3"] == outputs["none"]


def test_preemption_and_prefix_caching_keep_the_grammar(tiny_llama_dir):
    prompt = "a shared prefix that fills whole blocks of the cache: "
    params = [SamplingParams(max_tokens=80, temperature=0, structured_outputs=CONSTRAINTS[0], seed=i)
              for i in range(6)]
    roomy = run_to_completion(make_engine(tiny_llama_dir, enable_prefix_caching=False), [prompt] * 6, params)
    tight = make_engine(tiny_llama_dir, num_blocks=24, block_size=8)  # six requests cannot all fit
    cramped = run_to_completion(tight, [prompt] * 6, params)
    assert tight.scheduler.num_preemptions > 0
    assert tight.block_manager.prefix_cache_hits > 0
    assert cramped == roomy
    for ids in cramped:
        jsonschema.validate(json.loads(tight.tokenizer.decode(ids)), SCHEMA)


def test_grammar_completion_ends_the_request_even_with_ignore_eos(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    params = SamplingParams(max_tokens=50, temperature=1.0, seed=3, ignore_eos=True,
                            structured_outputs=StructuredOutputs(choice=CHOICES))
    engine.add_request("pick: ", params)
    outputs = [o for _ in range(60) if engine.has_unfinished() for o in engine.step()]
    final = outputs[-1].outputs[0]
    assert final.finish_reason == "stop" and final.text in CHOICES


def test_a_grammar_dead_end_finishes_clearly_and_frees_blocks(tiny_llama_dir):
    # The test tokenizer has no token for "é": after "!" no token can go on.
    engine = make_engine(tiny_llama_dir)
    engine.add_request("x", SamplingParams(max_tokens=20, structured_outputs=StructuredOutputs(regex="!é")))
    engine.add_request("y", SamplingParams(max_tokens=5, temperature=0))
    finished = _finish_all(engine)
    assert finished["req-0"].finish_reason == "grammar_dead_end" == finished["req-0"].stop_reason
    assert finished["req-0"].text == "!"
    assert finished["req-1"].finish_reason == "length"


def test_structured_outputs_need_a_tokenizer(tiny_llama_dir, tmp_path):
    save_tiny_model(tiny_llama_config(), tmp_path, seed=0)  # no tokenizer files
    engine = make_engine(tmp_path)
    with pytest.raises(ValueError, match="need a tokenizer"):
        engine.add_request([5, 6], SamplingParams(structured_outputs=StructuredOutputs(regex="a")))
    assert not engine.has_unfinished()


# ---- the masked target distribution, exactly -----------------------------------------
VOCAB = 12  # ids 0-2 special, 3-11 the characters ' ' to '('
PROMPT = [3, 5, 7, 1]
NUM_SAMPLES = 3000
FIRST = '!"#$%'  # ids 4-8 allowed first
SECOND = "#$%&'"  # ids 6-10 allowed second


@pytest.fixture(scope="module")
def small_vocab_models(tmp_path_factory):
    config = tiny_llama_config(vocab_size=VOCAB, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    target = save_tiny_model(config, tmp_path_factory.mktemp("masked_target"), seed=3)
    draft = save_tiny_model(config, tmp_path_factory.mktemp("masked_draft"), seed=4)  # proposes forbidden tokens
    for path in (target, draft):
        save_tiny_tokenizer(path, vocab_size=VOCAB)
    return target, draft


def _masked_reference_joint(target) -> np.ndarray:
    """transformers' target at temperature 1, each position renormalized over its allowed set."""
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    allowed = [[3 + " !\"#$%&'(".index(c) for c in chars] for chars in (FIRST, SECOND)]

    def masked_probs(ids: list[int], keep: list[int]) -> np.ndarray:
        with torch.no_grad():
            probs = torch.softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1).numpy()
        out = np.zeros(VOCAB)
        out[keep] = probs[keep] / probs[keep].sum()
        return out

    first = masked_probs(PROMPT, allowed[0])
    return np.stack([first[t] * masked_probs(PROMPT + [t], allowed[1]) if first[t] > 0 else np.zeros(VOCAB)
                     for t in range(VOCAB)])


@pytest.mark.parametrize("verification", ["auto", "rejection"])  # seeded: auto verifies by coupling
def test_speculative_constrained_samples_follow_the_masked_target(small_vocab_models, verification):
    target, draft = small_vocab_models
    regex = f"[{re.escape(FIRST)}][{re.escape(SECOND)}]"
    engine = make_engine(target, num_blocks=1200, block_size=4, max_num_seqs=512, method="draft",
                         draft_model=str(draft), num_speculative_tokens=2, controller="fixed",
                         verification=verification)
    for seed in range(NUM_SAMPLES):
        engine.add_request(PROMPT, SamplingParams(max_tokens=3, temperature=1.0, seed=seed,
                                                  structured_outputs=StructuredOutputs(regex=regex)))
    counts = np.zeros((VOCAB, VOCAB))
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                a, b = out.outputs[0].token_ids
                counts[a, b] += 1
    spec = engine.stats().spec
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens  # drafts were verified, some rejected
    joint = _masked_reference_joint(target)
    support = joint > 0
    assert counts[~support].sum() == 0
    statistic, df = chi2_statistic(counts[support], joint[support])
    assert statistic < chi2_quantile(0.999, df), (statistic, df)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_drafts_that_copy_a_finished_answer_past_its_end_keep_the_grammar(tiny_llama_dir, method):
    """The prompt holds earlier answers, each followed by the end of text (an agent's earlier
    turns): lookup drafts the rest of the answer and its end in one proposal. The grammar's
    state must stand after the accepted tokens only; the draft past its end once undid one
    token too many, and the request ended in a dead end (issue 71)."""
    if method == "suffix":
        pytest.importorskip("arctic_inference", reason="arctic-inference is built by `make install`")
    extra = {"ngram_draft_per_match_token": None} if method == "ngram" else {}
    engine = make_engine(tiny_llama_dir, method=method, num_speculative_tokens=4, controller="fixed", **extra)
    tokenizer = engine.tokenizer
    answer = tokenizer.encode("xyz", add_special_tokens=False)
    question = tokenizer.encode("say xyz: ", add_special_tokens=False)
    prompt = (question + answer + [tokenizer.eos_token_id]) * 3 + question
    engine.add_request(prompt, SamplingParams(max_tokens=10, temperature=0,
                                              structured_outputs=StructuredOutputs(regex="xyz")))
    final = _finish_all(engine)["req-0"]
    assert (final.finish_reason, final.text) == ("stop", "xyz")
    assert engine.spec_stats.num_draft_tokens >= len(answer)  # it drafted: the answer's rest and its end
