"""OpenAI's Responses API output: the ``response`` object and the events of a streamed one.

A response's output is the assistant's ``message`` (one ``output_text`` part) and the
``function_call`` items of the calls it made. It is ``completed`` when the model stopped by
itself and ``incomplete`` (reason ``max_output_tokens``) when it ran out of tokens. Streamed, the
events come in the order OpenAI sends them, each numbered (``sequence_number``):
``response.created``, ``response.in_progress``; for the message ``response.output_item.added``,
``response.content_part.added``, one ``response.output_text.delta`` per piece of text,
``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``; for
each call ``response.output_item.added``, ``response.function_call_arguments.delta`` and
``.done``, ``response.output_item.done``; last ``response.completed`` (or ``response.incomplete``).
An engine failure mid-stream is an ``error`` event. Asked for (``include``), the output tokens'
logprobs go in the ``output_text`` part (token, logprob, bytes, ``top_logprobs``) and, streamed,
with each text delta (token, logprob, ``top_logprobs``, as OpenAI's delta event holds them).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from cluster.api.openai_responses import ChoiceState, chat_logprobs
from cluster.api.tool_calls import ToolCall
from cluster.api.responses_protocol import ResponsesRequest


@dataclass(frozen=True)
class ResponseIds:
    response_id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=lambda: int(time.time()))


def response_usage(state: ChoiceState) -> dict:
    """Usage in the Responses layout. Prompt-cache writes are not counted by the engines (every full
    block of a prompt is cached as it is computed): ``cache_write_tokens`` is 0."""
    return {"input_tokens": state.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": state.num_cached_tokens, "cache_write_tokens": 0},
            "output_tokens": state.num_output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": state.num_prompt_tokens + state.num_output_tokens}


def _status(state: ChoiceState | None) -> str:
    if state is None or state.finish_reason is None:
        return "in_progress"
    return "incomplete" if state.finish_reason == "length" else "completed"


def _text_part(text: str, logprobs: list[dict] | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(ids: ResponseIds, text: str | None, status: str, logprobs: list[dict] | None = None) -> dict:
    """The assistant's message: no content while it is open (``text`` None), else its text."""
    content = [] if text is None else [_text_part(text, logprobs)]
    return {"type": "message", "id": ids.message_id, "status": status, "role": "assistant", "content": content}


def output_logprobs(body: ResponsesRequest, entries) -> list[dict] | None:
    """The ``output_text`` logprobs of these tokens' entries, None when the request did not ask."""
    return chat_logprobs(entries, body.top_logprobs or 0)["content"] if body.wants_logprobs() else None


def _delta_logprobs(entries: list[dict]) -> list[dict]:
    """Logprobs as a text delta event holds them: no bytes."""
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
            for e in entries]


def call_item(call: ToolCall, status: str = "completed") -> dict:
    """A function call the model made (``arguments`` empty while it is open)."""
    return {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id,
            "name": call.name, "arguments": call.arguments if status == "completed" else "", "status": status}


def output_items(ids: ResponseIds, state: ChoiceState, logprobs: list[dict] | None = None) -> list[dict]:
    """A finished choice's output: its message (when it has text or made no calls; ``logprobs``: its
    tokens', every output token's), then its calls."""
    text = state.text if state.content is None else state.content
    items = [message_item(ids, text, _status(state), logprobs)] if text or not state.tool_calls else []
    return items + [call_item(call) for call in state.tool_calls]


def response_object(ids: ResponseIds, body: ResponsesRequest, model: str, state: ChoiceState | None,
                    output: list[dict] | None = None) -> dict:
    """The ``response``: in progress (``state`` None or unfinished: no output yet) or finished, its
    output ``output`` (a stream's items in the order sent) or the state's."""
    status = _status(state)
    finished = status != "in_progress"
    if finished and output is None:
        output = output_items(ids, state, output_logprobs(body, state.logprobs))
    return {
        "id": ids.response_id, "object": "response", "created_at": ids.created_at, "status": status,
        "completed_at": int(time.time()) if finished else None,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": model,
        "output": output if finished else [],
        "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id, "reasoning": None, "store": body.store,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": {"type": "text"}} if body.text is None or body.text.format is None
        else {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)},
        "tool_choice": body.tool_choice or "auto", "tools": list(body.tools or []),
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": body.truncation or "disabled",
        "usage": response_usage(state) if finished else None,
        "user": body.user, "metadata": body.metadata or {},
    }


class ResponseEvents:
    """The events of one streamed response, numbered as they are made. Output items open as
    their first piece comes: the message at its first text, each call when it is whole."""

    def __init__(self, ids: ResponseIds, body: ResponsesRequest, model: str) -> None:
        self.ids, self.body, self.model = ids, body, model
        self.items: list[dict] = []  # the output items sent, each whole once done
        self._text: str | None = None  # the open message's text (None: no message open)
        self._logprobs: list[dict] = []  # the open message's tokens' logprobs, when asked for
        self._number = 0

    def _event(self, type_: str, **fields) -> dict:
        event = {"type": type_, "sequence_number": self._number, **fields}
        self._number += 1
        return event

    def _where(self) -> dict:
        return {"item_id": self.ids.message_id, "output_index": len(self.items), "content_index": 0}

    def start(self) -> list[dict]:
        response = response_object(self.ids, self.body, self.model, None)
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def text(self, text: str, logprobs: list[dict] = ()) -> list[dict]:
        """A piece of the message's text (opening the message first), with its tokens' ``logprobs``
        (``output_logprobs`` entries) when asked for."""
        events = [] if self._text is not None else self._open_message()
        self._text += text
        self._logprobs.extend(logprobs)
        return events + [self._event("response.output_text.delta", **self._where(), delta=text,
                                     logprobs=_delta_logprobs(logprobs))]

    def more_logprobs(self, logprobs: list[dict]) -> None:
        """Logprobs of tokens that sent no text (the last ones, say): the open message's still."""
        if self._text is not None:
            self._logprobs.extend(logprobs)

    def call(self, call: ToolCall) -> list[dict]:
        """A whole function call: the message before it is done."""
        events = self._close_message("completed")
        index = len(self.items)
        item = call_item(call)
        events += [self._event("response.output_item.added", output_index=index, item=call_item(call, "in_progress")),
                   self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                               delta=call.arguments),
                   self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               name=call.name, arguments=call.arguments),
                   self._event("response.output_item.done", output_index=index, item=item)]
        self.items.append(item)
        return events

    def finish(self, state: ChoiceState) -> list[dict]:
        """``state`` has finished: the open message (an empty one when nothing was sent) is done, then
        the whole response."""
        events = self._open_message() if self._text is None and not self.items else []
        events += self._close_message(_status(state))
        response = response_object(self.ids, self.body, self.model, state, self.items)
        last = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return events + [self._event(last, response=response)]

    def error(self, message: str, code: str = "server_error") -> dict:
        return self._event("error", code=code, message=message, param=None)

    def _open_message(self) -> list[dict]:
        self._text = ""
        return [self._event("response.output_item.added", output_index=len(self.items),
                            item=message_item(self.ids, None, "in_progress")),
                self._event("response.content_part.added", **self._where(), part=_text_part(""))]

    def _close_message(self, status: str) -> list[dict]:
        if self._text is None:
            return []
        text, where, logprobs = self._text, self._where(), self._logprobs
        item = message_item(self.ids, text, status, logprobs)
        self._text, self._logprobs = None, []
        self.items.append(item)
        return [self._event("response.output_text.done", **where, text=text, logprobs=_delta_logprobs(logprobs)),
                self._event("response.content_part.done", **where, part=_text_part(text, logprobs)),
                self._event("response.output_item.done", output_index=where["output_index"], item=item)]
