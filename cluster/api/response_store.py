"""Stored responses of the Responses API: what ``previous_response_id``, ``GET /v1/responses/{id}``,
``DELETE`` and ``input_items`` read.

Each stored response keeps three things: the ``response`` object as it was answered, its
``input_items`` (the request's input as items, each with an id) and its ``context``, the items a
response that names it as ``previous_response_id`` continues from (the context it continued,
its input, its output). Instructions are not part of a context: each request brings its own,
as in OpenAI's API.

The store is bounded: past ``max_responses`` the one used longest ago (stored, read or
continued) is dropped, and naming it afterwards is a 404 like any unknown id. Plain Python,
safe across threads; one instance serves the whole cluster (``deployments/response_store.py``).
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from cluster.api.errors import UnsupportedFieldError

_ID_PREFIX = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_"}


@dataclass(frozen=True)
class StoredResponse:
    response: dict
    input_items: list[dict]
    context: list[dict]


def input_items(value: str | list[dict]) -> list[dict]:
    """A request's ``input`` as the items the API lists: a string is one user message; a message's
    string content becomes one text part; an item without an id or a status gets one."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    items = []
    for item in value:
        item = {"type": "message", "status": "completed", **item}
        if item["type"] == "message":
            if isinstance(item.get("content"), str):
                kind = "output_text" if item.get("role") == "assistant" else "input_text"
                part = {"type": kind, "text": item["content"]}
                item["content"] = [{**part, "annotations": []} if kind == "output_text" else part]
        if not isinstance(item.get("id"), str):
            item["id"] = _ID_PREFIX.get(item["type"], "item_") + uuid.uuid4().hex
        items.append(item)
    return items


class ResponseStore:
    def __init__(self, max_responses: int) -> None:
        if max_responses < 1:
            raise ValueError(f"max_responses must be at least 1, got {max_responses}")
        self.max_responses = max_responses
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, response: dict, items: list[dict], context: list[dict]) -> None:
        """Keep a finished response, its input items and the context a continuation reads."""
        with self._lock:
            self._responses[response["id"]] = StoredResponse(response, items, context)
            self._responses.move_to_end(response["id"])
            while len(self._responses) > self.max_responses:
                self._responses.popitem(last=False)

    def _used(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._responses.get(response_id)
            if stored is not None:
                self._responses.move_to_end(response_id)
            return stored

    def response(self, response_id: str) -> dict | None:
        stored = self._used(response_id)
        return None if stored is None else stored.response

    def context(self, response_id: str) -> list[dict] | None:
        """What a response continuing ``response_id`` reads before its own input (None: unknown)."""
        stored = self._used(response_id)
        return None if stored is None else stored.context

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._responses.pop(response_id, None) is not None

    def input_items(self, response_id: str) -> list[dict] | None:
        """A response's input items, in the order sent (None: unknown)."""
        stored = self._used(response_id)
        return None if stored is None else stored.input_items


def items_page(items: list[dict], response_id: str, after: str | None = None, limit: int = 20,
               order: str = "desc") -> dict:
    """One page of a response's input items, OpenAI's list object: ``order`` asc (as sent) or desc,
    at most ``limit`` (1-100), starting after the item whose id is ``after``."""
    if order not in ("asc", "desc"):
        raise UnsupportedFieldError("order", f"order must be asc or desc, got {order!r}")
    if not 1 <= limit <= 100:
        raise UnsupportedFieldError("limit", f"limit must be between 1 and 100, got {limit}")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise UnsupportedFieldError("after", f"after names no input item of {response_id}: {after!r}")
        start = ids.index(after) + 1
    page = ordered[start:start + limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(ordered)}
