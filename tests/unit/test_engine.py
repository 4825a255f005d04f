"""Engine behaviour on a tiny model: bad input, seeds, stops, logprobs, aborts under load."""

from __future__ import annotations

import random

import pytest

from cluster.engine.llm import LLM
from cluster.shared.sampling_params import SamplingParams
from tests.engine_helpers import drain, make_engine


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), device="cpu", num_blocks=64, max_model_len=128)


# ---- bad input ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-3), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(logprobs=50), "logprobs"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_bad_sampling_params_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_engine_keeps_serving(llm):
    engine = llm.engine
    good = engine.add_request("Hello there", SamplingParams(max_tokens=4, temperature=0))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("")
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("x" * 200)
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        engine.add_request([5, 999])
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("again", request_id=good)
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert list(finished) == [good]
    assert len(finished[good].outputs[0].token_ids) == 4
    engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.pool.num_blocks


def test_allowed_token_ids_that_leave_nothing_to_sample_are_refused(llm):
    engine = llm.engine
    eos = engine.eos_token_id
    from cluster.structured.constraint import StructuredOutputs

    for params in (SamplingParams(allowed_token_ids=[eos, 9], stop_token_ids=[9], min_tokens=2),
                   SamplingParams(allowed_token_ids=[5, 6], structured_outputs=StructuredOutputs(regex="a+")),
                   SamplingParams(allowed_token_ids=[5, 300])):
        with pytest.raises(ValueError) as err:
            engine.add_request("hi", params)
        assert err.value.param == "allowed_token_ids"
    ok = llm.generate(["hi"], SamplingParams(allowed_token_ids=[eos, 9], min_tokens=2, max_tokens=4,
                                             temperature=0))[0].outputs[0]
    assert ok.token_ids[:2] == [9, 9]  # only 9 may come before min_tokens


def test_prompt_that_cannot_fit_in_the_kv_pool_is_refused(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="KV cache"):
        engine.add_request(list(range(3, 20)))


def test_unknown_model_name_is_a_clear_error():
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        LLM("no-such-model", device="cpu")


def test_corrupt_weights_are_a_clear_error(tiny_llama_dir, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(str(broken), device="cpu")


# ---- sampling -------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible_across_batches(llm):
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    alone = llm.generate(["abc"], seeded)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=12, temperature=1.0) for _ in range(3)]
    batch = llm.generate(["zz", "abc", "qwerty", "m"], [others[0], seeded, others[1], others[2]])
    assert batch[1].outputs[0].token_ids == alone
    different = llm.generate(["abc"], SamplingParams(max_tokens=12, temperature=1.0, seed=99))
    assert different[0].outputs[0].token_ids != alone


def test_max_tokens_and_length_finish(llm):
    out = llm.generate(["hi"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5
    assert out.outputs[0].finish_reason == "length"
    assert out.usage.prompt_tokens == 2 and out.usage.completion_tokens == 5


def test_stop_token_ids_and_stop_strings(llm):
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    reference = llm.generate(["The cat"], greedy)[0].outputs[0]
    stop_id = reference.token_ids[5]
    first = reference.token_ids.index(stop_id)
    out = llm.generate(["The cat"], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                  stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == reference.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id

    text = reference.text
    stop = text[7:10]
    out = llm.generate(["The cat"], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                  stop=[stop]))[0].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert stop not in out.text
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_the_stop_tokens_text_is_left_out_unless_asked_for(llm):
    """As vLLM: the stop id stays in the token ids, its text only with include_stop_str_in_output."""
    greedy = dict(max_tokens=30, temperature=0, ignore_eos=True)
    reference = llm.generate(["The cat"], SamplingParams(**greedy))[0].outputs[0]
    stop_id = reference.token_ids[5]
    first = reference.token_ids.index(stop_id)
    decode = llm.engine.tokenizer.decode
    for include in (False, True):
        out = llm.generate(["The cat"], SamplingParams(stop_token_ids=[stop_id], include_stop_str_in_output=include,
                                                      **greedy))[0].outputs[0]
        assert out.token_ids == reference.token_ids[: first + 1] and out.stop_reason == stop_id
        assert out.text == decode(reference.token_ids[: first + 1 if include else first])


def test_include_stop_str_keeps_the_stop_string(llm):
    greedy = dict(max_tokens=30, temperature=0, ignore_eos=True)
    text = llm.generate(["The cat"], SamplingParams(**greedy))[0].outputs[0].text
    stop = text[7:10]
    out = llm.generate(["The cat"], SamplingParams(stop=[stop], include_stop_str_in_output=True,
                                                  **greedy))[0].outputs[0]
    assert out.text == text[: text.index(stop) + len(stop)] and out.stop_reason == stop


def test_stop_strings_wait_for_min_tokens(llm):
    greedy = dict(max_tokens=30, temperature=0, ignore_eos=True)
    reference = llm.generate(["The cat"], SamplingParams(**greedy))[0].outputs[0]
    decode = llm.engine.tokenizer.decode
    # A stop string that the output's 3rd token completes: min_tokens=3 keeps it from stopping there.
    stop = decode(reference.token_ids[:3])[-1:]
    early = llm.generate(["The cat"], SamplingParams(stop=[stop], **greedy))[0].outputs[0]
    assert len(early.token_ids) <= 3
    late = llm.generate(["The cat"], SamplingParams(stop=[stop], min_tokens=3, **greedy))[0].outputs[0]
    assert len(late.token_ids) > 3 and late.token_ids == reference.token_ids[: len(late.token_ids)]
    assert late.text.startswith(decode(reference.token_ids[:3]))


def test_delta_outputs_carry_each_steps_part_and_add_up_to_the_cumulative_ones(llm):
    """``add_prepared(cumulative=False)`` (the served path): text, token ids and logprobs of each
    output are that step's only; joined they are the cumulative request's final output."""
    engine = llm.engine
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2, stop=["zz"])
    whole = engine.add_prepared(engine.make_request("The cat", params))
    parts = engine.add_prepared(engine.make_request("The cat", params), cumulative=False)
    outputs: dict[str, list] = {whole: [], parts: []}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out.outputs[0])
    final = outputs[whole][-1]
    deltas = outputs[parts]
    assert len(deltas) > 1
    for d in deltas:
        assert (d.text, d.token_ids, d.logprobs) == (d.delta_text, d.delta_token_ids, d.delta_logprobs)
    assert "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids and len(final.token_ids) == 20
    assert [lp for d in deltas for lp in d.logprobs] == final.logprobs
    assert engine.block_manager.num_free_blocks == engine.block_manager.pool.num_blocks


def test_bad_words_never_appear_and_change_nothing_before_them(llm):
    greedy = dict(max_tokens=30, temperature=0, ignore_eos=True)
    reference = llm.generate(["The cat"], SamplingParams(**greedy))[0].outputs[0]
    tokenizer = llm.engine.tokenizer
    ids = reference.token_ids
    # Two tokens of the greedy output that are the tokenizer's own spelling of their text.
    pairs = [ids[i:i + 2] for i in range(len(ids) - 1)
             if tokenizer.encode(tokenizer.decode(ids[i:i + 2]), add_special_tokens=False) == ids[i:i + 2]]
    assert pairs
    word = tokenizer.decode(pairs[0])
    out = llm.generate(["The cat"], SamplingParams(bad_words=[word], **greedy))[0].outputs[0]
    assert word not in out.text and len(out.token_ids) == 30
    first = reference.text.index(word)
    assert out.text[:first] == reference.text[:first]  # the same until the word would begin
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=[" "])
    with pytest.raises(ValueError, match="at most 128") as err:
        llm.engine.add_request("The cat", SamplingParams(bad_words=[f"w{i}" for i in range(200)]))
    assert err.value.param == "bad_words"


def test_streamed_deltas_never_show_a_stop_string(llm):
    engine = llm.engine
    greedy = dict(max_tokens=30, temperature=0, ignore_eos=True)
    text = llm.generate(["The dog"], SamplingParams(**greedy))[0].outputs[0].text
    stop = text[12:15]
    engine.add_request("The dog", SamplingParams(stop=[stop], **greedy))
    pieces = []
    while engine.has_unfinished():
        for out in engine.step():
            pieces.append(out.outputs[0].delta_text)
            assert stop not in "".join(pieces)
    assert "".join(pieces) == text[: text.index(stop)]


def test_logprobs_are_returned_for_each_token(llm):
    out = llm.generate(["abc"], SamplingParams(max_tokens=4, temperature=0, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy takes the most likely token
        assert 3 <= len(entry) <= 4
        assert all(lp.logprob <= 0 for lp in entry.values())


def test_min_tokens_blocks_eos(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", num_blocks=64)
    eos = llm.engine.eos_token_id
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=1.0, seed=3, logprobs=0)
    for out in llm.generate(["a", "b", "c"], params):
        assert eos not in out.outputs[0].token_ids
        assert len(out.outputs[0].token_ids) == 8


# ---- random workload with aborts ------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_with_aborts_frees_every_block(tiny_llama_dir, seed):
    rng = random.Random(seed)
    verification = ["auto", "rejection", "coupled"][seed]
    engine = make_engine(tiny_llama_dir, num_blocks=24, block_size=4, max_num_seqs=6,
                         max_num_batched_tokens=rng.choice([8, 32, 256]), verification=verification)
    live: set[str] = set()
    added = 0
    for _ in range(400):
        if added < 40 and rng.random() < 0.4:
            prompt = [rng.randrange(3, 256) for _ in range(rng.randint(1, 40))]
            params = SamplingParams(max_tokens=rng.randint(1, 24), temperature=rng.choice([0, 1.0]),
                                    seed=rng.choice([None, 7]), ignore_eos=rng.random() < 0.5)
            live.add(engine.add_request(prompt, params))
            added += 1
        if live and rng.random() < 0.15:
            victim = rng.choice(sorted(live))
            engine.abort(victim)
            live.discard(victim)
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
        engine.check_invariants()
        if added >= 40 and not engine.has_unfinished():
            break
    drain(engine, live)
    assert not live
    assert engine.scheduler.num_preemptions > 0  # the pool was small enough to force them
    assert engine.block_manager.num_free_blocks == engine.block_manager.pool.num_blocks
    # coupled: every random request was given a seed of its own, and each was dropped when it ended
    assert engine.worker.runner.own_seeds == ({} if verification == "coupled" else None)
