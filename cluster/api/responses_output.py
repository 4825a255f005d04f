"""OpenAI's Responses API output: the ``response`` object and the events of a streamed one.

A response holds one output item, the assistant's ``message`` with one ``output_text`` part. It
is ``completed`` when the model stopped by itself and ``incomplete`` (reason
``max_output_tokens``) when it ran out of tokens. Streamed, the events come in the order OpenAI
sends them, each numbered (``sequence_number``): ``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, then one
``response.output_text.delta`` per piece of text, then ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done`` and ``response.completed`` (or
``response.incomplete``); an engine failure mid-stream is an ``error`` event.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from cluster.api.openai_responses import ChoiceState
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


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(ids: ResponseIds, state: ChoiceState | None) -> dict:
    """The assistant's message: no content while it starts, its whole text once finished."""
    content = [_text_part(state.text)] if state is not None and state.finish_reason is not None else []
    return {"type": "message", "id": ids.message_id, "status": _status(state), "role": "assistant",
            "content": content}


def response_object(ids: ResponseIds, body: ResponsesRequest, model: str, state: ChoiceState | None) -> dict:
    """The ``response``: in progress (``state`` None or unfinished: no output yet) or finished."""
    status = _status(state)
    finished = status != "in_progress"
    return {
        "id": ids.response_id, "object": "response", "created_at": ids.created_at, "status": status,
        "completed_at": int(time.time()) if finished else None,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": model,
        "output": [message_item(ids, state)] if finished else [],
        "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
        "previous_response_id": None, "reasoning": None, "store": body.store,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": {"type": "text"}} if body.text is None or body.text.format is None
        else {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)},
        "tool_choice": body.tool_choice or "auto", "tools": [],
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": body.truncation or "disabled",
        "usage": response_usage(state) if finished else None,
        "user": body.user, "metadata": body.metadata or {},
    }


class ResponseEvents:
    """The events of one streamed response, numbered as they are made."""

    def __init__(self, ids: ResponseIds, body: ResponsesRequest, model: str) -> None:
        self.ids, self.body, self.model = ids, body, model
        self._number = 0

    def _event(self, type_: str, **fields) -> dict:
        event = {"type": type_, "sequence_number": self._number, **fields}
        self._number += 1
        return event

    def _where(self) -> dict:
        return {"item_id": self.ids.message_id, "output_index": 0, "content_index": 0}

    def start(self) -> list[dict]:
        response = response_object(self.ids, self.body, self.model, None)
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response),
                self._event("response.output_item.added", output_index=0, item=message_item(self.ids, None)),
                self._event("response.content_part.added", **self._where(), part=_text_part(""))]

    def delta(self, text: str) -> dict:
        return self._event("response.output_text.delta", **self._where(), delta=text, logprobs=[])

    def finish(self, state: ChoiceState) -> list[dict]:
        """``state`` has finished: the closing events, the last one the whole response."""
        response = response_object(self.ids, self.body, self.model, state)
        last = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return [self._event("response.output_text.done", **self._where(), text=state.text, logprobs=[]),
                self._event("response.content_part.done", **self._where(), part=_text_part(state.text)),
                self._event("response.output_item.done", output_index=0, item=message_item(self.ids, state)),
                self._event(last, response=response)]

    def error(self, message: str, code: str = "server_error") -> dict:
        return self._event("error", code=code, message=message, param=None)
