"""The OpenAI conformance tests of ``tests/serve/test_openai_api.py``, run against each
replica group of one cluster: ``native`` and ``vllm`` (the ``client`` fixture pins the
group). Greedy texts are compared with Tandem's engine run offline, so the vLLM group
passing them also shows its greedy output equals ours on these prompts."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.serve.conftest import API_KEY, MODEL
from tests.serve.test_openai_api import PROMPT
from tests.serve.test_openai_api import test_logit_bias_through_the_openai_client as _logit_bias_native
from tests.serve.test_openai_api import test_seeded_sampling_repeats_and_n_choices_differ as _seeded_native
from tests.serve.test_openai_api import (  # noqa: F401  (collected here with this tier's fixtures)
    reference,
    test_chat_completion_uses_the_models_template,
    test_completion_matches_the_engine_and_counts_usage,
    test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks,
    test_logprobs_in_both_layouts,
    test_models_list,
    test_prompt_logprobs_and_chat_echo,
    test_responses_api_through_the_openai_client,
    test_stop_string_ends_the_output_before_it,
    test_streamed_deltas_concatenate_to_the_whole_text,
    test_token_id_prompts_and_batched_prompts,
    test_vllms_prompt_fields_through_the_openai_client,
    test_vllms_stop_fields_through_the_openai_client,
    test_vllms_token_id_fields,
)


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL, "prompt": [1, 2, 100000]}, "prompt"),  # outside the vocabulary
    ({"model": MODEL, "prompt": "x " * 300}, "prompt"),  # longer than max_model_len 256
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "temperature": 3}, "temperature"),
])
def test_bad_input_is_the_same_400_from_both_engines(server_url, group, body, param):
    headers = {"Authorization": f"Bearer {API_KEY}", "X-Tandem-Group": group}
    response = httpx.post(f"{server_url}/v1/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_unknown_group_is_400(server_url):
    headers = {"Authorization": f"Bearer {API_KEY}", "X-Tandem-Group": "nope"}
    response = httpx.post(f"{server_url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, headers=headers,
                          timeout=60)
    assert response.status_code == 400 and "native, vllm" in response.json()["error"]["message"]


def test_the_openai_client_sees_typed_errors_from_both(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[1, 2, 100000], max_tokens=4)
    assert client.completions.create(model=MODEL, prompt="still here", max_tokens=4,
                                     temperature=0).usage.completion_tokens == 4


def test_logit_bias(client, group, reference):
    """The native engine's test as it is (checked against transformers' sequence_bias in
    tests/unit/test_parity_tiny.py). vLLM's engine refuses logit_bias under speculative decoding,
    which this tier's groups run: its refusal reaches the client as a 400."""
    if group == "native":
        _logit_bias_native(client, reference)
        return
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logit_bias={"12": 5})


def test_seeded_sampling_repeats_and_n_choices_differ(client, group):
    """The native engine's test as it is. For vLLM, what a seed fixes is narrower: vLLM
    promises no bit-exact repeats, and on this tier three seeded 16-token samples agreed for
    11 tokens and then parted (a near-tie at temperature 1 flipped in a speculative step), so
    its check is the first token: every seed's first token repeats, sampled from one prefill
    of one shape (vLLM's prefix cache is warmed first: a request that misses it prefills in
    other shapes, vLLM issue #40896). At temperature 1 the first token after PROMPT has
    sum p^2 = 0.24 (measured with transformers), so six seeds would all repeat by chance
    with p ~ 2e-4 if the seed were dropped. Different seeds and the n=2 choices (seeds seed
    and seed + 1) must still differ over 16 tokens."""
    if group == "native":
        _seeded_native(client)
        return

    def sample(seed, n=1, max_tokens=16):
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=1.0,
                                         seed=seed, n=n)

    sample(7, max_tokens=1)
    firsts = {seed: [sample(seed, max_tokens=1).choices[0].text for _ in range(2)] for seed in range(1, 7)}
    assert all(a == b for a, b in firsts.values()), firsts
    assert sample(7).choices[0].text != sample(8).choices[0].text
    both = sample(7, n=2)
    assert [c.index for c in both.choices] == [0, 1] and both.choices[0].text != both.choices[1].text
    assert both.usage.completion_tokens == 32


# Greedy after PROMPT, both engines: " with a quick brown bear.\n\nThe original sentence is a classic example
# of a hom..." (" a" is token 253 and comes at outputs 2, 13 and 17; "." is token 30, output 6).
@pytest.mark.parametrize("fields", [
    {"stop": [" a"]},
    {"stop": [" a"], "min_tokens": 2},  # the first " a" is within min_tokens: the next one stops it
    {"stop": [" a"], "include_stop_str_in_output": True},
    {"stop": ["a q", "a"]},  # both end in the same tokens' text: the one ending first wins
    {"stop": ["e o", "sent"], "min_tokens": 3},
    {"stop_token_ids": [30]},
    {"stop_token_ids": [30], "include_stop_str_in_output": True},
    {"stop_token_ids": [253], "min_tokens": 3},
    # allowed_token_ids: " with" then " a" or " the" only, until " a" stops it
    {"stop": [" a"], "allowed_token_ids": [351, 253, 260], "min_tokens": 2},
    # bad_words: " brown bear" may not be completed (" brown fox" follows instead)
    {"stop": ["."], "bad_words": ["brown bear", "The"]},
])
def test_stops_end_the_text_as_vllms_engine_does(server_url, fields):
    """The same greedy request to each group: vLLM's engine applies the stop rules itself, so
    the native group must give the same text, finish_reason and stop_reason."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, **fields}
    answers = {}
    for group in ("native", "vllm"):
        headers = {"Authorization": f"Bearer {API_KEY}", "X-Tandem-Group": group}
        response = httpx.post(f"{server_url}/v1/completions", json=body, headers=headers, timeout=300)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        answers[group] = (choice["text"], choice["finish_reason"], choice["stop_reason"])
    assert answers["native"] == answers["vllm"]
    assert answers["vllm"][1] == "stop"


def test_prompt_logprobs_are_vllms(server_url):
    """The same prompt_logprobs request to each group: the same prompt tokens scored, the same
    ranks and top tokens, logprobs equal to float32 rounding across two engines' kernels."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 3}
    answers = {}
    for group in ("native", "vllm"):
        headers = {"Authorization": f"Bearer {API_KEY}", "X-Tandem-Group": group}
        response = httpx.post(f"{server_url}/v1/completions", json=body, headers=headers, timeout=300)
        assert response.status_code == 200, response.text
        answers[group] = response.json()["choices"][0]["prompt_logprobs"]
    native, vllm = answers["native"], answers["vllm"]
    assert len(native) == len(vllm) > 2 and native[0] is None and vllm[0] is None
    for ours, theirs in zip(native[1:], vllm[1:]):
        assert set(ours) == set(theirs)
        for token, entry in ours.items():
            assert entry["rank"] == theirs[token]["rank"]
            assert entry["decoded_token"] == theirs[token]["decoded_token"]
            assert entry["logprob"] == pytest.approx(theirs[token]["logprob"], abs=2e-3)
