"""The OpenAI API of a running cluster, through the real ``openai`` client."""

from __future__ import annotations

import httpx
import openai
import pytest

from cluster.engine.llm import LLM, apply_chat_template
from cluster.shared.sampling_params import SamplingParams

from tests.serve.conftest import API_KEY, MODEL

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def reference(serve_config):
    """The engine alone, offline: what the cluster must reproduce under greedy decoding."""
    return LLM(config=serve_config)


def _greedy(reference, prompt: str, max_tokens: int, **kwargs) -> str:
    out = reference.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, **kwargs))
    return out[0].outputs[0].text


def test_models_list(client, serve_config):
    models = client.models.list()
    assert models.data[0].id == MODEL and models.data[0].model_extra["parent"] is None
    # The rest are the LoRA adapters some group serves (the serve tests' fast group serves one).
    assert all(m.model_extra["parent"] == MODEL for m in models.data[1:])
    assert models.data[0].object == "model"
    assert models.data[0].max_model_len == serve_config.model.max_model_len  # vLLM's field
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_completion_matches_the_engine_and_counts_usage(client, reference):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    choice = response.choices[0]
    assert choice.text == _greedy(reference, PROMPT, 12)
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(reference.tokenizer.encode(PROMPT))
    assert response.usage.completion_tokens == 12
    assert response.usage.total_tokens == response.usage.prompt_tokens + 12


def test_streamed_deltas_concatenate_to_the_whole_text(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_continuous_usage_stats_put_each_choices_usage_in_every_chunk(client, reference):
    """vLLM's stream_options.continuous_usage_stats: with include_usage, every chunk carries the
    usage of its choice so far, and the last chunk the whole request's."""
    prompt_tokens = len(reference.tokenizer.encode(PROMPT))
    for chat in (False, True):
        options = {"include_usage": True, "continuous_usage_stats": True}
        if chat:
            stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                                    max_tokens=8, temperature=0, stream=True, stream_options=options,
                                                    extra_body={"ignore_eos": True}, n=2)
        else:
            stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                               stream_options=options, extra_body={"ignore_eos": True}, n=2)
        chunks = list(stream)
        counts = {0: [], 1: []}
        for chunk in chunks[:-1]:
            (choice,) = chunk.choices
            counts[choice.index].append(chunk.usage.completion_tokens)
            assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
            assert chat or chunk.usage.prompt_tokens == prompt_tokens
        for seen in counts.values():
            assert seen == sorted(seen) and seen[-1] == 8
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_chat_completion_uses_the_models_template(client, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    prompt = apply_chat_template(reference.tokenizer, messages)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == _greedy(reference, prompt, 10)
    assert response.usage.prompt_tokens == len(reference.tokenizer.encode(prompt, add_special_tokens=False))

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == response.choices[0].message.content


def test_without_max_tokens_chat_fills_the_context_and_completions_stop_at_16(client, serve_config):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count"}],
                                          temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length"
    max_model_len = serve_config.model.max_model_len
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == max_model_len
    text = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    assert (text.choices[0].finish_reason, text.usage.completion_tokens) == ("length", 16)


def test_stop_string_ends_the_output_before_it(client, reference):
    full = _greedy(reference, PROMPT, 24)
    stop = full[6:8]
    assert stop and stop in full
    expected = full[: full.index(stop)]
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert response.choices[0].text == expected
    assert response.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_vllms_stop_fields_through_the_openai_client(client, reference):
    """stop_reason names the stop string or id (vLLM's field, an extra of the openai client's
    models); include_stop_str_in_output keeps it; a stop id's own text is left out otherwise."""
    full = _greedy(reference, PROMPT, 24)
    stop = full[6:8]
    kept = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == full[: full.index(stop) + len(stop)]
    assert kept.choices[0].stop_reason == stop
    ids = reference.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    stop_id = ids[0].outputs[0].token_ids[4]
    for include in (False, True):
        chat = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                         extra_body={"stop_token_ids": [stop_id], "ignore_eos": True,
                                                     "include_stop_str_in_output": include})
        chunks = list(chat)
        expected = reference.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                               stop_token_ids=[stop_id],
                                                               include_stop_str_in_output=include))
        assert "".join(c.choices[0].text for c in chunks) == expected[0].outputs[0].text
        assert (chunks[-1].choices[0].finish_reason, chunks[-1].choices[0].stop_reason) == ("stop", stop_id)
    length = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert length.choices[0].stop_reason is None


def test_vllms_prompt_fields_through_the_openai_client(client, reference):
    tokens = reference.tokenizer.encode(PROMPT)
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 2})
    assert cut.usage.prompt_tokens == 2
    assert cut.choices[0].text == _greedy(reference, tokens[-2:], 6)
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    continued = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    prompt = reference.tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert continued.choices[0].message.content == _greedy(reference, prompt, 6)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                       extra_body={"use_beam_search": True})
    assert err.value.body["param"] == "use_beam_search"


def test_logit_bias_through_the_openai_client(client, reference):
    plain = reference.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    first = plain[0].outputs[0].token_ids[0]
    bias = {str(first): -100, "12": 5}  # away from the greedy first token, towards token 12
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logit_bias=bias,
                                         extra_body={"ignore_eos": True})
    expected = reference.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                           logit_bias={first: -100.0, 12: 5.0}))
    assert response.choices[0].text == expected[0].outputs[0].text != plain[0].outputs[0].text


def test_seeded_sampling_repeats_and_n_choices_differ(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed,
                                         n=2)

    first, again, other = sample(7), sample(7), sample(8)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert [c.index for c in first.choices] == [0, 1]
    assert first.choices[0].text != first.choices[1].text  # choice j samples with seed + j
    assert [c.text for c in first.choices] != [c.text for c in other.choices]
    assert first.usage.completion_tokens == 32


def test_logprobs_in_both_layouts(client):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = response.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(top) >= 3 for top in lp.top_logprobs)
    # Greedy: the sampled token is the most likely one.
    assert all(abs(max(top.values()) - value) < 1e-5 for top, value in zip(lp.top_logprobs, lp.token_logprobs))

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hey"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(entry.top_logprobs) == 2 for entry in content)
    assert "".join(entry.token for entry in content) == chat.choices[0].message.content


def test_token_id_prompts_and_batched_prompts(client):
    response = client.completions.create(model=MODEL, prompt=[[5, 6, 7, 8], [9, 10]], max_tokens=3, temperature=0)
    assert [c.index for c in response.choices] == [0, 1]
    assert response.usage.prompt_tokens == 6


def test_tokenize_and_detokenize_as_vllms_routes(server_url, client, reference):
    """vLLM's /tokenize (a prompt, or messages rendered as chat completions render them) and
    /detokenize, against the model's own tokenizer."""
    auth = {"Authorization": f"Bearer {API_KEY}"}

    def post(route, body):
        return httpx.post(f"{server_url}{route}", json=body, headers=auth, timeout=60)

    tokenizer = reference.tokenizer
    got = post("/tokenize", {"model": MODEL, "prompt": PROMPT, "return_token_strs": True}).json()
    assert got["tokens"] == tokenizer.encode(PROMPT) and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == 1024 and got["token_strs"] == tokenizer.convert_ids_to_tokens(got["tokens"])
    messages = [{"role": "user", "content": "Hi there"}]
    chat = post("/tokenize", {"messages": messages}).json()
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(prompt, add_special_tokens=False) and chat["token_strs"] is None
    used = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert used.usage.prompt_tokens == chat["count"]
    assert post("/detokenize", {"tokens": got["tokens"]}).json() == {"prompt": tokenizer.decode(got["tokens"])}
    for route, body, param in [("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
                               ("/tokenize", {"prompt": 5}, "prompt"),
                               ("/tokenize", {"messages": messages, "continue_final_message": True},
                                "continue_final_message")]:
        response = post(route, body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert post("/tokenize", {"model": "nope", "prompt": "x"}).status_code == 404


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(client, reference):
    """What lm-eval-harness's loglikelihood requests send (echo, logprobs 1, max_tokens 1 or 0,
    temperature 0): the prompt's text, then per prompt token its text and its logprob given the
    tokens before it (none for the first), as the engine's own prompt_logprobs give them offline."""
    tokenizer = reference.tokenizer
    ids = tokenizer.encode(PROMPT)
    offline = reference.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    generated = offline.outputs[0].text
    for max_tokens, stream in [(1, False), (0, False), (1, True), (0, True)]:
        response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                             echo=True, logprobs=1, stream=stream)
        chunks = list(response) if stream else [response]
        text = "".join(c.choices[0].text for c in chunks)
        tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
        values = [v for c in chunks for v in c.choices[0].logprobs.token_logprobs]
        top = [t for c in chunks for t in c.choices[0].logprobs.top_logprobs]
        assert text == PROMPT + (generated if max_tokens else "")
        assert len(tokens) == len(values) == len(ids) + max_tokens
        assert tokens[: len(ids)] == [tokenizer.decode([t]) for t in ids]
        assert values[0] is None and top[0] is None
        for position in range(1, len(ids)):
            assert values[position] == pytest.approx(offline.prompt_logprobs[position][ids[position]].logprob,
                                                     abs=1e-4)
            assert values[position] in top[position].values()  # the prompt's own token is always listed
        assert chunks[-1].choices[0].finish_reason == "length"


def test_prompt_logprobs_and_chat_echo(client, reference):
    """vLLM's prompt_logprobs (each completion choice and the top of a chat completion; refused
    under stream) and chat echo (the last message's content before a reply that continues it)."""
    ids = reference.tokenizer.encode(PROMPT)
    offline = reference.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))[0]
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                         extra_body={"prompt_logprobs": 2})
    got = response.choices[0].model_extra["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for position in range(1, len(ids)):
        assert set(got[position]) == {str(t) for t in offline.prompt_logprobs[position]}
        entry = got[position][str(ids[position])]
        expected = offline.prompt_logprobs[position][ids[position]]
        assert entry["logprob"] == pytest.approx(expected.logprob, abs=1e-4) and entry["rank"] == expected.rank
    assert response.usage.prompt_tokens_details.cached_tokens == 0  # the whole prompt ran
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    assert err.value.body["param"] == "prompt_logprobs"

    messages = [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": "Once upon"}]
    options = {"add_generation_prompt": False, "continue_final_message": True, "prompt_logprobs": 0, "echo": True}
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                          extra_body=options)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                           extra_body={"add_generation_prompt": False,
                                                       "continue_final_message": True})
    assert chat.choices[0].message.content == "Once upon" + plain.choices[0].message.content
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                            stream=True, extra_body=options)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == chat.choices[0].message.content


def test_vllms_token_id_fields(client, reference):
    """vLLM's return_token_ids (what RL trainers read: the output's ids and the prompt's, whole and
    streamed) and return_tokens_as_token_ids (logprobs name tokens token_id:N)."""
    prompt_ids = reference.tokenizer.encode(PROMPT)
    offline = reference.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0))[0].outputs[0].token_ids
    fields = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1,
                                      extra_body=fields).choices[0]
    assert whole.model_extra["token_ids"] == offline and whole.model_extra["prompt_token_ids"] == prompt_ids
    assert whole.logprobs.tokens == [f"token_id:{t}" for t in offline]
    chunks = [c.choices[0] for c in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6,
                                                                 temperature=0, stream=True, extra_body=fields)]
    assert [t for c in chunks for t in c.model_extra["token_ids"]] == offline
    assert chunks[0].model_extra["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c.model_extra for c in chunks[1:])

    messages = [{"role": "user", "content": "hey"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                          logprobs=True, extra_body=fields)
    ids = chat.choices[0].model_extra["token_ids"]
    assert len(ids) == chat.usage.completion_tokens and len(chat.model_extra["prompt_token_ids"]) == \
        chat.usage.prompt_tokens
    assert [entry.token for entry in chat.choices[0].logprobs.content] == [f"token_id:{t}" for t in ids]
    stream = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                                 stream=True, extra_body=fields))
    assert stream[0].model_extra["prompt_token_ids"] == chat.model_extra["prompt_token_ids"]
    assert [t for c in stream[1:] for t in c.choices[0].model_extra["token_ids"]] == ids


def test_per_request_spec_decode_metrics_only_when_asked(client):
    """return_spec_decode_metrics: vLLM's per-request metrics.speculative_decoding, whole and in a stream's
    last chunk (with the usage); the serve tests' groups draft for themselves, so every draft is accepted."""
    def check(metrics: dict) -> None:
        spec = metrics["speculative_decoding"]
        assert spec["num_spec_steps"] > 0 and spec["num_spec_tokens"] == 2  # k of the serve tests
        assert spec["num_accepted_draft_tokens"] == spec["num_draft_tokens"] > 0
        assert spec["draft_acceptance_rate"] == 1.0
        assert spec["mean_acceptance_length"] == 1 + spec["num_accepted_draft_tokens"] / spec["num_spec_steps"]
        assert sum(spec["acceptance_histogram"]) == spec["num_spec_steps"]

    fields = {"return_spec_decode_metrics": True, "ignore_eos": True}
    messages = [{"role": "user", "content": PROMPT}]
    assert "metrics" not in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                                      temperature=0).model_extra
    check(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body=fields).model_extra["metrics"])
    check(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                         extra_body=fields).model_extra["metrics"])
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, extra_body=fields))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    check(chunks[-1].model_extra["metrics"])
    assert all("metrics" not in c.model_extra for c in chunks[:-1])


def test_responses_api_through_the_openai_client(client):
    """POST /v1/responses: the openai client's responses.create, whole and streamed, and its stream
    helper; the text is the chat completion's of the same messages, refusals name their field."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Tell a story"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    whole = client.responses.create(model=MODEL, instructions="be brief", input="Tell a story", max_output_tokens=8,
                                    temperature=0)
    assert whole.output_text == chat.choices[0].message.content
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (chat.usage.prompt_tokens, 8)
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Tell a story"}]}]
    events = list(client.responses.create(model=MODEL, instructions="be brief", input=items, max_output_tokens=8,
                                          temperature=0, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # The client's stream helper checks the events against its snapshot as they come (its
    # get_final_response wants response.completed, which a response cut at max_output_tokens is not).
    with client.responses.stream(model=MODEL, instructions="be brief", input="Tell a story", max_output_tokens=8,
                                 temperature=0) as stream:
        helped = list(stream)
    assert helped[-1].type == "response.incomplete" and helped[-1].response.output_text == whole.output_text
    # text.format constrains the output (a structured output): it ends by itself, so the response completes.
    answer = {"format": {"type": "json_schema", "name": "answer", "schema": {"type": "string", "enum": ["yes", "no"]}}}
    with client.responses.stream(model=MODEL, input="Is it raining?", max_output_tokens=16, text=answer) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text in ('"yes"', '"no"')
    bad_schema = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}
    for fields, param in [({"conversation": "conv_1"}, "conversation"),
                          ({"max_output_tokens": 10**6}, "max_output_tokens"),  # the chat route's check, renamed
                          ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
                           "input"),
                          ({"text": bad_schema}, "text.format")]:  # the constraint's check, renamed
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(**{"model": MODEL, "input": "hi", **fields})
        assert err.value.body["param"] == param
        message = err.value.body["message"]  # in the Responses API's names, not the chat request's
        assert not any(name in message for name in ("max_tokens", "max_completion_tokens", "response_format"))
    assert "'max_output_tokens' is too large" in client_error(client, max_output_tokens=10**6)
    assert client_error(client, text=bad_schema).startswith("text.format: ")


def client_error(client, **fields) -> str:
    """The message of the 400 that /v1/responses answers ``fields`` with."""
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(**{"model": MODEL, "input": "hi", **fields})
    return err.value.body["message"]


def test_a_priority_goes_to_the_groups_that_schedule_by_it(client):
    """vLLM's priority field: served by the group whose scheduler.policy is priority (the router sends
    it there), refused by name when pinned to a first-come-first-served group; 0 goes anywhere."""
    served = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0,
                                       extra_body={"priority": -2})
    pinned = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0,
                                       extra_body={"priority": -2}, extra_headers={"X-Tandem-Group": "slow"})
    assert served.choices[0].text == pinned.choices[0].text and served.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=3, extra_body={"priority": 2},
                                  extra_headers={"X-Tandem-Group": "fast"})
    assert err.value.body["param"] == "priority" and "scheduler.policy: priority" in err.value.body["message"]
    client.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body={"priority": 0},
                              extra_headers={"X-Tandem-Group": "fast"})
    with pytest.raises(openai.BadRequestError) as err:  # the Responses API takes it too
        client.responses.create(model=MODEL, input="hi", max_output_tokens=2, extra_body={"priority": 2},
                                extra_headers={"X-Tandem-Group": "fast"})
    assert err.value.body["param"] == "priority"
    assert client.responses.create(model=MODEL, input="hi", max_output_tokens=2, temperature=0,
                                   extra_body={"priority": 2}).usage.output_tokens == 2


def test_responses_output_logprobs_through_the_openai_client(client):
    """include message.output_text.logprobs with top_logprobs: the output tokens' logprobs are the chat
    completion's of the same messages, whole and streamed (the deltas' together); another include
    and a top_logprobs past 20 are 400s naming their field."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Tell a story"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                          top_logprobs=2)
    expected = [(t.token, round(t.logprob, 4), [(a.token, round(a.logprob, 4)) for a in t.top_logprobs])
                for t in chat.choices[0].logprobs.content]
    fields = dict(model=MODEL, instructions="be brief", input="Tell a story", max_output_tokens=6, temperature=0,
                  include=["message.output_text.logprobs"], top_logprobs=2)
    whole = client.responses.create(**fields)
    part = whole.output[0].content[0]
    assert [(lp.token, round(lp.logprob, 4), [(a.token, round(a.logprob, 4)) for a in lp.top_logprobs])
            for lp in part.logprobs] == expected
    assert len(expected) == whole.usage.output_tokens == 6 and all(len(e[2]) == 2 for e in expected)
    events = list(client.responses.create(**fields, stream=True))
    streamed = [(lp.token, round(lp.logprob, 4)) for e in events if e.type == "response.output_text.delta"
                for lp in e.logprobs]
    assert streamed == [(token, logprob) for token, logprob, _ in expected]
    assert client.responses.create(**{**fields, "include": None}).output[0].content[0].logprobs == []
    for bad, param in [({"include": ["file_search_call.results"]}, "include"), ({"top_logprobs": 21}, "top_logprobs")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(**{**fields, **bad})
        assert err.value.body["param"] == param


def test_responses_are_stored_continued_and_deleted(client):
    """store / previous_response_id through the openai client: a continued response reads the stored
    chain (not its instructions), exactly as the chat completion of those messages; retrieve,
    input_items, delete, cancel, and the 404s for what is not stored."""
    first = client.responses.create(model=MODEL, instructions="be brief", input="Tell a story", max_output_tokens=6,
                                    temperature=0)
    assert client.responses.retrieve(first.id) == first
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="Go on", max_output_tokens=6,
                                     temperature=0)
    messages = [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "Go on"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens and second.previous_response_id == first.id
    # Streamed, the response is stored before its last event: continued at once, from the stream's own id.
    events = list(client.responses.create(model=MODEL, previous_response_id=second.id, input="More", stream=True,
                                          max_output_tokens=4, temperature=0))
    third = events[-1].response
    assert client.responses.retrieve(third.id).output_text == third.output_text
    chat = client.chat.completions.create(model=MODEL, messages=messages + [
        {"role": "assistant", "content": second.output_text}, {"role": "user", "content": "More"}], max_tokens=4,
        temperature=0)
    assert third.output_text == chat.choices[0].message.content
    items = list(client.responses.input_items.list(second.id))
    assert [(i.type, i.role, i.content[0].text) for i in items] == [("message", "user", "Go on")]
    assert client.responses.delete(first.id) is None  # the client returns nothing for a deletion
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    assert client.responses.retrieve(second.id).output_text == second.output_text  # it keeps its own chain
    unkept = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    assert unkept.store is False
    for call in (lambda: client.responses.retrieve(unkept.id), lambda: client.responses.delete(first.id),
                 lambda: client.responses.input_items.list(unkept.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, previous_response_id=unkept.id, input="hi", max_output_tokens=2)
    assert err.value.body["param"] == "previous_response_id" and unkept.id in err.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(second.id)
