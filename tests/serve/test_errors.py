"""Bad requests get OpenAI-shaped errors with the right status, and the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.serve.conftest import API_KEY, MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _post(url: str, path: str, body, headers=AUTH) -> httpx.Response:
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    return httpx.post(f"{url}{path}", headers={**headers, "Content-Type": "application/json"}, timeout=60,
                      **kwargs)


def _assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    return error


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL, "prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "temperature": 3}, "temperature"),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p"),
    ({"model": MODEL, "prompt": "hi", "n": 100}, "n"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"five": 1.0}}, "logit_bias"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"100000": 1.0}}, "logit_bias"),  # outside the vocabulary
    ({"model": MODEL, "prompt": 42}, "prompt"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": [1, 2, 100000]}, "prompt"),
    ({"model": MODEL, "prompt": "x" * 1100}, "prompt"),  # longer than max_model_len 1024
    ({"model": MODEL}, "prompt"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 10**9}, "max_tokens"),  # past the context of 1024
    ({"model": MODEL, "prompt": "hi", "truncate_prompt_tokens": 2000}, "truncate_prompt_tokens"),
    ({"model": MODEL, "prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),  # vLLM's limit: 20
    ({"model": MODEL, "prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"model": MODEL, "prompt": "hi", "use_beam_search": True}, "use_beam_search"),  # vLLM's, not implemented
])
def test_invalid_completion_requests_are_400(server_url, body, param):
    _assert_error(_post(server_url, "/v1/completions", body), 400, param)


def test_invalid_chat_requests_are_400(server_url):
    _assert_error(_post(server_url, "/v1/chat/completions", {"model": MODEL, "messages": []}), 400, "messages")
    bad_role = {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}
    _assert_error(_post(server_url, "/v1/chat/completions", bad_role), 400)
    tools = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}
    _assert_error(_post(server_url, "/v1/chat/completions", tools), 400, "tools")


def test_max_tokens_past_the_context_is_refused_in_vllms_words(server_url):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5000}
    error = _assert_error(_post(server_url, "/v1/chat/completions", body), 400, "max_completion_tokens")
    assert error["message"].startswith("'max_tokens' or 'max_completion_tokens' is too large: 5000. "
                                       "This model's maximum context length is 1024 tokens")


def test_a_lone_surrogate_is_400_naming_the_field(server_url):
    # JSON may escape half of a UTF-16 pair alone; Python decodes it to a str no tokenizer takes.
    prompt = '{"model": "%s", "prompt": "a\\udcff", "max_tokens": 2}' % MODEL
    error = _assert_error(_post(server_url, "/v1/completions", prompt), 400, "prompt")
    assert "lone surrogate" in error["message"]
    chat = '{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % MODEL
    _assert_error(_post(server_url, "/v1/chat/completions", chat), 400, "messages")


def test_bad_json_is_400(server_url):
    error = _assert_error(_post(server_url, "/v1/completions", '{"model": "tiny", "prompt": '), 400)
    assert "JSON" in error["message"]


def test_unknown_model_is_404(server_url):
    error = _assert_error(_post(server_url, "/v1/completions", {"model": "gpt-9", "prompt": "hi"}), 404, "model")
    assert error["code"] == "model_not_found"


def test_api_key_is_required(server_url):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    _assert_error(_post(server_url, "/v1/completions", body, headers={}), 401)
    _assert_error(_post(server_url, "/v1/completions", body, headers={"Authorization": "Bearer wrong"}), 401)
    assert httpx.get(f"{server_url}/v1/models", timeout=30).status_code == 401
    for route in ("/debug/router", "/debug/engines", "/debug/timeline"):  # behind the key too
        assert httpx.get(f"{server_url}{route}", timeout=30).status_code == 401
        ok = httpx.get(f"{server_url}{route}", headers=AUTH, timeout=30)
        assert ok.status_code == 200, route
    for route in ("/tokenize", "/detokenize"):
        _assert_error(_post(server_url, route, {"prompt": "hi", "tokens": [1]}, headers={}), 401)
    assert httpx.get(f"{server_url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{server_url}/version", timeout=30).json()["version"]


def test_openai_client_raises_typed_errors_and_server_keeps_serving(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=4)
    response = client.completions.create(model=MODEL, prompt="still here", max_tokens=4, temperature=0)
    assert response.usage.completion_tokens == 4
