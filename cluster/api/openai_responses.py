"""OpenAI response bodies (whole and streamed) built from the engine's deltas.

Shapes follow OpenAI's API reference: ``text_completion`` / ``chat.completion``
objects (each choice also carries vLLM's ``stop_reason``: the stop string or stop token id
that ended it, else null), ``*.chunk`` objects for server-sent events, ``usage`` with
``prompt_tokens_details.cached_tokens``, and the two logprobs layouts (the legacy
completions one with parallel lists, the chat one with ``content`` entries). Tool calls
(``cluster/api/tool_calls.py``) go in ``message.tool_calls`` (content None when the output
is only calls) and streamed in ``delta.tool_calls``, each call whole in one delta; a choice
that made calls and stopped by itself finishes with ``tool_calls``.

``echo`` (:class:`Echo`) puts the prompt's text before a completion's output (with ``logprobs``,
the prompt tokens' logprobs before the output's; the first token has none) and the last
message's content before a chat reply. vLLM's ``prompt_logprobs`` go in each completion choice and
at the top of a chat completion, per prompt token (null for the first): token id -> ``logprob``,
``rank``, ``decoded_token``. vLLM's ``return_token_ids`` adds each choice's output ids
(``token_ids``; streamed: each chunk's) and the prompt's (``prompt_token_ids``: in each completion
choice, at the top of a chat completion; streamed: in the first chunk of each choice);
``return_tokens_as_token_ids`` names logprobs' tokens ``token_id:N`` (:func:`with_token_id_names`).
Asked for (``return_spec_decode_metrics``, ``serve.per_request_spec_decode_metrics``), the request's
speculative decoding goes in vLLM's top-level ``metrics`` object (:func:`spec_decode_metrics`); streamed,
in the last chunk, the one with the usage.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from cluster.api.tool_calls import Parsed, ToolCall
from cluster.shared.outputs import Logprob, SpecDecodeCounts, TokenLogprobs
from cluster.hosting.protocol import GenerateDelta


@dataclass(frozen=True)
class Echo:
    """What ``echo`` puts before a choice's output."""

    text: str  # the prompt's text (completions) or the last message's content (chat)
    first_token: str = ""  # completions: the prompt's first token as text (its logprobs entry is empty)
    only: bool = False  # completions with max_tokens 0: the prompt alone (the one token run for it is dropped)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass
class ChoiceState:
    """Everything one choice has produced so far."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it (vLLM's field)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    tool_calls: list[ToolCall] = field(default_factory=list)
    content: str | None = None  # set when the text was parsed for tool calls; else the text is the content
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # when asked for: per prompt token
    prompt_token_ids: list[int] = field(default_factory=list)
    sent_first: bool = False  # a stream sent this choice's first chunk (with the echo, if any)
    next_offset: int = 0  # a stream's text offset for its next logprobs token (after the tokens sent)
    spec_decode: SpecDecodeCounts | None = None  # from the last delta (None: its engine counts none per request)

    def add(self, delta: GenerateDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            self.finish_reason = _finish(delta)
            self.stop_reason = delta.stop_reason
        self.num_prompt_tokens = delta.num_prompt_tokens or self.num_prompt_tokens
        self.num_output_tokens = max(self.num_output_tokens, delta.num_output_tokens)
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        if delta.spec_decode is not None:
            self.spec_decode = delta.spec_decode

    def sent(self, logprobs: dict | None) -> None:
        """A stream sent a chunk with these legacy ``logprobs``: offsets go on from its last token, as
        in vLLM (not from the text, which lags the tokens while a stop string may still match)."""
        self.sent_first = True
        if logprobs and logprobs["tokens"]:
            self.next_offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])

    def set_parsed(self, parsed: Parsed) -> None:
        """The whole text parsed for tool calls (``tool_calls.parse_tool_calls``)."""
        self.content, self.tool_calls = parsed.content, list(parsed.calls)

    def message(self) -> dict:
        """The chat ``message``: content None when the output is only tool calls."""
        if not self.tool_calls:
            return {"role": "assistant", "content": self.text if self.content is None else self.content}
        return {"role": "assistant", "content": self.content or None,
                "tool_calls": [call.message_dict() for call in self.tool_calls]}

    def chat_finish_reason(self) -> str | None:
        return _with_tool_calls(self.finish_reason, bool(self.tool_calls))


def usage(choices: list[ChoiceState], prompt_indices: list[int]) -> dict:
    """Usage over all choices; ``prompt_indices[i]`` is the prompt that ``choices[i]``
    continues. Each prompt and its cache hits count once, even when n > 1."""
    prompts: dict[int, int] = {}
    cached_per_prompt: dict[int, int] = {}
    for choice, prompt in zip(choices, prompt_indices, strict=True):
        prompts[prompt] = max(prompts.get(prompt, 0), choice.num_prompt_tokens)
        cached_per_prompt[prompt] = max(cached_per_prompt.get(prompt, 0), choice.num_cached_tokens)
    prompt_tokens = sum(prompts.values())
    completion_tokens = sum(c.num_output_tokens for c in choices)
    cached = sum(cached_per_prompt.values())
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def spec_decode_metrics(choices: list[ChoiceState]) -> dict:
    """vLLM's per-request ``metrics`` object (its ``--per-request-spec-decode-metrics summary``) over
    all choices: ``speculative_decoding`` with the steps that verified drafts, the draft tokens
    proposed and accepted, their ratios (null without a step or a draft), the histogram of accepted
    drafts per step, and ``num_spec_tokens``, the most drafts a step asked for (vLLM's fixed k; here
    k may change from step to step). ``speculative_decoding`` is null when no choice's engine counted
    them (a vLLM group)."""
    counted = [c.spec_decode for c in choices if c.spec_decode is not None]
    if not counted:
        return {"speculative_decoding": None}
    total = sum(counted[1:], counted[0])
    return {"speculative_decoding": {
        "mean_acceptance_length": total.mean_acceptance_length,
        "draft_acceptance_rate": total.draft_acceptance_rate,
        "acceptance_histogram": list(total.acceptance_histogram),
        "num_spec_steps": total.num_spec_steps,
        "num_accepted_draft_tokens": total.num_accepted_tokens,
        "num_draft_tokens": total.num_draft_tokens,
        "num_spec_tokens": max(len(total.acceptance_histogram) - 1, 0),
    }}


def completion_logprobs(entries: list[TokenLogprobs | None], start_offset: int = 0, first_token: str = "") -> dict:
    """The legacy layout; a None entry (an echoed prompt's first token, ``first_token``) has no values."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = start_offset
    for entry in entries:
        if entry is None:
            tokens.append(first_token)
            token_logprobs.append(None)
            top.append(None)
            offsets.append(offset)
            offset += len(first_token)
            continue
        sampled_id, sampled = next(iter(entry.items()))
        text = sampled.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(sampled.logprob)
        top.append({(lp.decoded_token or str(t)): lp.logprob for t, lp in entry.items()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def prompt_logprobs_json(entries: list[TokenLogprobs | None] | None) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt token, None or token id -> logprob, rank, decoded token
    (a logprob of -inf as -9999.0, which JSON can carry)."""
    if entries is None:
        return None
    return [None if entry is None else
            {str(token): {"logprob": max(lp.logprob, -9999.0), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for token, lp in entry.items()}
            for entry in entries]


def token_id_name(token: int) -> str:
    """A token as ``return_tokens_as_token_ids`` names it (for tokens whose text is not valid UTF-8 alone)."""
    return f"token_id:{token}"


def with_token_id_names(delta: GenerateDelta) -> GenerateDelta:
    """The delta with every logprob entry's token named ``token_id:N`` instead of by its text."""
    def rename(entry: TokenLogprobs | None) -> TokenLogprobs | None:
        if entry is None:
            return None
        return {token: Logprob(lp.logprob, lp.rank, token_id_name(token)) for token, lp in entry.items()}

    return replace(delta, logprobs=None if delta.logprobs is None else [rename(e) for e in delta.logprobs],
                   prompt_logprobs=None if delta.prompt_logprobs is None
                   else [rename(e) for e in delta.prompt_logprobs])


def echoed_completion(state: ChoiceState, echo: Echo | None) -> tuple[str, list[TokenLogprobs | None]]:
    """A whole completion choice's text and logprob entries, the echoed prompt's first."""
    if echo is None:
        return state.text, list(state.logprobs)
    prompt = list(state.prompt_logprobs or [])
    if echo.only:
        return echo.text, prompt
    return echo.text + state.text, prompt + state.logprobs


def echoed_chunk(state: ChoiceState, delta: GenerateDelta, echo: Echo | None) -> tuple[str, list]:
    """A streamed completion delta's text and logprob entries, for a state that has not added the
    delta yet: the echo goes before the first chunk sent."""
    if echo is None:
        return delta.text, delta.logprobs or []
    text, entries = ("", []) if echo.only else (delta.text, delta.logprobs or [])
    if not state.sent_first:
        prompt = delta.prompt_logprobs if delta.prompt_logprobs is not None else state.prompt_logprobs
        text, entries = echo.text + text, list(prompt or []) + entries
    return text, entries


def chat_logprobs(entries: list[TokenLogprobs], num_top: int) -> dict:
    content = []
    for entry in entries:
        items = list(entry.items())
        _, sampled = items[0]
        ranked = sorted(items, key=lambda item: item[1].rank)[:num_top] if num_top else []
        content.append({
            **_chat_token(sampled.decoded_token, sampled.logprob),
            "top_logprobs": [_chat_token(lp.decoded_token, lp.logprob) for _, lp in ranked],
        })
    return {"content": content}


def _chat_token(text: str | None, logprob: float) -> dict:
    text = text or ""
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def completion_body(response_id: str, created: int, model: str, choices: list[ChoiceState],
                    usage_dict: dict, with_logprobs: bool, echoes: list[Echo | None] | None = None,
                    token_ids: bool = False, metrics: dict | None = None) -> dict:
    """``echoes[i]``: what choice ``i`` echoes (None: nothing); ``token_ids``: vLLM's ``return_token_ids``;
    ``metrics``: vLLM's per-request ``metrics`` (None: left out)."""
    echoes = echoes or [None] * len(choices)
    body_choices = []
    for c, echo in zip(choices, echoes, strict=True):
        text, entries = echoed_completion(c, echo)
        body_choices.append({
            "index": c.index,
            "text": text,
            "logprobs": completion_logprobs(entries, 0, echo.first_token if echo else "") if with_logprobs else None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
            "prompt_logprobs": prompt_logprobs_json(c.prompt_logprobs),
            **({"token_ids": c.token_ids, "prompt_token_ids": c.prompt_token_ids} if token_ids else {}),
        })
    body = {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": body_choices, "usage": usage_dict}
    if metrics is not None:
        body["metrics"] = metrics
    return body


def chat_body(response_id: str, created: int, model: str, choices: list[ChoiceState],
              usage_dict: dict, num_logprobs: int | None, echo: Echo | None = None, token_ids: bool = False,
              metrics: dict | None = None) -> dict:
    """``echo``: the last message's content goes before each reply's content; ``token_ids``:
    vLLM's ``return_token_ids``; ``metrics``: vLLM's per-request ``metrics`` (None: left out)."""
    body_choices = []
    for c in choices:
        message = c.message()
        if echo is not None:
            message["content"] = echo.text + (message["content"] or "")
        body_choices.append({
            "index": c.index,
            "message": message,
            "logprobs": chat_logprobs(c.logprobs, num_logprobs) if num_logprobs is not None else None,
            "finish_reason": c.chat_finish_reason(),
            "stop_reason": c.stop_reason,
            **({"token_ids": c.token_ids} if token_ids else {}),
        })
    body = {"id": response_id, "object": "chat.completion", "created": created, "model": model,
            "choices": body_choices, "usage": usage_dict,
            "prompt_logprobs": prompt_logprobs_json(choices[0].prompt_logprobs if choices else None)}
    if token_ids:
        body["prompt_token_ids"] = choices[0].prompt_token_ids if choices else []
    if metrics is not None:
        body["metrics"] = metrics
    return body


def completion_chunk(response_id: str, created: int, model: str, index: int, delta: GenerateDelta,
                     offset: int, with_logprobs: bool, include_usage: bool, usage_now: dict | None = None,
                     text: str | None = None, entries: list | None = None, first_token: str = "",
                     token_ids: bool = False, prompt_token_ids: list[int] | None = None) -> dict:
    """``usage_now``: the choice's usage so far, for vLLM's ``continuous_usage_stats`` (else null);
    ``text`` and ``entries`` (logprobs) replace the delta's (an echo: ``echoed_chunk``); ``token_ids``:
    the delta's ids go in the chunk (``return_token_ids``); ``prompt_token_ids``, when given, too."""
    text = delta.text if text is None else text
    entries = (delta.logprobs or []) if entries is None else entries
    chunk = {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": index,
            "text": text,
            "logprobs": completion_logprobs(entries, offset, first_token) if with_logprobs else None,
            "finish_reason": _finish(delta),
            "stop_reason": delta.stop_reason,
        }],
    }
    if token_ids:
        chunk["choices"][0]["token_ids"] = delta.token_ids
    if prompt_token_ids is not None:
        chunk["choices"][0]["prompt_token_ids"] = prompt_token_ids
    if include_usage:
        chunk["usage"] = usage_now
    return chunk


def chat_chunk(response_id: str, created: int, model: str, index: int, delta_body: dict,
               delta: GenerateDelta | None, num_logprobs: int | None, include_usage: bool,
               made_tool_calls: bool = False, usage_now: dict | None = None, token_ids: bool = False,
               prompt_token_ids: list[int] | None = None) -> dict:
    """``made_tool_calls``: the choice has sent calls, so a natural stop finishes as ``tool_calls``;
    ``usage_now``, ``token_ids`` and ``prompt_token_ids`` (at the chunk's top, as vLLM) as in
    ``completion_chunk``."""
    logprobs = None
    if num_logprobs is not None and delta is not None and delta.logprobs:
        logprobs = chat_logprobs(delta.logprobs, num_logprobs)
    chunk = {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{
            "index": index,
            "delta": delta_body,
            "logprobs": logprobs,
            "finish_reason": _with_tool_calls(_finish(delta), made_tool_calls) if delta is not None else None,
            "stop_reason": delta.stop_reason if delta is not None else None,
        }],
    }
    if token_ids and delta is not None:
        chunk["choices"][0]["token_ids"] = delta.token_ids
    if prompt_token_ids is not None:
        chunk["prompt_token_ids"] = prompt_token_ids
    if include_usage:
        chunk["usage"] = usage_now
    return chunk


def usage_chunk(response_id: str, created: int, model: str, obj: str, usage_dict: dict,
                metrics: dict | None = None) -> dict:
    """A stream's last chunk: the usage, and vLLM's per-request ``metrics`` when given."""
    chunk = {"id": response_id, "object": obj, "created": created, "model": model, "choices": [],
             "usage": usage_dict}
    if metrics is not None:
        chunk["metrics"] = metrics
    return chunk


def _finish(delta: GenerateDelta) -> str | None:
    """OpenAI's finish reasons only: ``length``, else ``stop``. An output a structured grammar cut
    (no token could go on) stops with ``stop_reason`` ``grammar_dead_end``, vLLM's field for
    what stopped it."""
    if delta.finish_reason is None:
        return None
    return "length" if delta.finish_reason == "length" else "stop"


def _with_tool_calls(finish_reason: str | None, made_tool_calls: bool) -> str | None:
    return "tool_calls" if made_tool_calls and finish_reason == "stop" else finish_reason
