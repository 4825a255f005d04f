"""Tool calls in a model's output: the grammar that forces them, and the parser that finds them.

Two output syntaxes (the format is the model's, ``ModelConfig.tool_call_format``):

- blocks (formats ``hermes`` and ``prompt``): each call is
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; several calls are
  blocks one after another, a newline between them (forced calls may leave the three
  newlines out, so that a vocabulary without a newline token can still call).
- ``llama3_json``: each call is a JSON object ``{"name": ..., "parameters": {...}}``
  (``arguments`` is accepted too); several are separated by ``;`` (and whitespace).

The parser is incremental (``feed`` deltas, then ``finish``) and the whole-text parse is the
same machine fed once, so a streamed response carries exactly the calls and content of the
unstreamed one. Contract of the parse: text outside calls is content; whitespace that only
touches a call is dropped; a block or object that does not decode to a call (bad JSON, no
name, arguments not an object) stays content, verbatim; an unterminated block is content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import NamedTuple

from cluster.structured.constraint import json_schema_grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
BLOCK_FORMATS = ("hermes", "prompt")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=new_call_id)

    def message_dict(self) -> dict:
        """As in ``choices[i].message.tool_calls``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def delta_dict(self, index: int) -> dict:
        """As in a chunk's ``delta.tool_calls``: the whole call in one piece."""
        return {"index": index, **self.message_dict()}


class Parsed(NamedTuple):
    content: str
    calls: list[ToolCall]


# ---- the grammar of forced calls ---------------------------------------------------
def forced_call_grammar(parameters: dict[str, dict], tool_format: str, several: bool) -> str:
    """A Lark grammar (llguidance's dialect) whose sentences are one call (or, with ``several``,
    one or more) to one of ``parameters``' functions (name -> parameters schema), in the
    format's syntax, the arguments matching the function's schema."""
    key = "parameters" if tool_format == "llama3_json" else "arguments"
    rules = [f"fn_{i}: {json_schema_grammar(_call_schema(name, schema, key))}"
             for i, (name, schema) in enumerate(parameters.items())]
    alternatives = " | ".join(f"fn_{i}" for i in range(len(parameters)))
    if tool_format == "llama3_json":
        call, separator = f"call: {alternatives}", '"; "'
    else:  # the newlines are optional: a vocabulary without a newline token can still call
        call, separator = f'call: "{_lark(OPEN)}" "\\n"? ({alternatives}) "\\n"? "{_lark(CLOSE)}"', '"\\n"?'
    start = f"start: call ({separator} call)*" if several else "start: call"
    return "\n".join([start, call, *rules])


def _call_schema(name: str, parameters: dict, key: str) -> dict:
    """``{"name": <const>, key: parameters}``; the parameters' ``$defs`` move to the root so that
    their ``#/$defs/...`` references still resolve."""
    parameters = dict(parameters)
    parameters.pop("$schema", None)
    schema = {"type": "object", "properties": {"name": {"const": name}, key: parameters},
              "required": ["name", key], "additionalProperties": False}
    for defs in ("$defs", "definitions"):
        if defs in parameters:
            schema[defs] = parameters.pop(defs)
    return schema


def _lark(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


# ---- parsing -----------------------------------------------------------------------
def parse_tool_calls(text: str, tool_format: str, max_calls: int | None = None) -> Parsed:
    """The calls and the content of a whole output."""
    return ToolCallParser(tool_format, max_calls).parse(text)


class ToolCallParser:
    """Feed an output's deltas in order, then call ``finish`` once; each call returns the
    content and the calls that are settled so far. Text that may still become a call (an
    opening tag, a ``{`` in llama3_json, whitespace that may touch a call) is held back until
    it is settled. ``max_calls``: calls beyond it are dropped."""

    def __init__(self, tool_format: str, max_calls: int | None = None) -> None:
        self.blocks = tool_format in BLOCK_FORMATS
        self.max_calls = max_calls
        self.buffer = ""          # unsettled text
        self.in_call = False      # blocks: buffer starts with OPEN; llama3_json: buffer starts with "{"
        self.pending_space = ""   # trailing whitespace of content, held
        self.after_call = False   # the last settled thing was a call
        self.num_calls = 0
        self._content: list[str] = []
        self._calls: list[ToolCall] = []

    @property
    def found_calls(self) -> bool:
        return self.num_calls > 0

    def parse(self, text: str) -> Parsed:
        """A fresh parser's whole-text parse: ``feed(text)`` then ``finish()``, joined."""
        first, last = self.feed(text), self.finish()
        return Parsed(first.content + last.content, first.calls + last.calls)

    def feed(self, text: str) -> Parsed:
        self.buffer += text
        if self.blocks:
            self._settle_blocks()
        elif not self.in_call:
            start = self.buffer.find("{")
            if start < 0:
                self._add_content(self.buffer)
                self.buffer = ""
            else:
                self._add_content(self.buffer[:start])
                self.buffer, self.in_call = self.buffer[start:], True
        return self._take()

    def finish(self) -> Parsed:
        if not self.blocks and self.in_call:
            self._settle_json(self.buffer)
        else:
            self._add_content(self.buffer)
        self.buffer = ""
        if not self.found_calls:
            self._content.append(self.pending_space)
        self.pending_space = ""
        return self._take()

    # ---- blocks --------------------------------------------------------------------
    def _settle_blocks(self) -> None:
        while True:
            if not self.in_call:
                start = self.buffer.find(OPEN)
                if start < 0:
                    keep = _partial_suffix(self.buffer, OPEN)
                    self._add_content(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return
                self._add_content(self.buffer[:start])
                self.buffer, self.in_call = self.buffer[start:], True
            end = self.buffer.find(CLOSE)
            if end < 0:
                return
            end += len(CLOSE)
            block, self.buffer, self.in_call = self.buffer[:end], self.buffer[end:], False
            call = _decode_call(block[len(OPEN):-len(CLOSE)], ("arguments", "parameters"))
            if call is None:
                self._add_content(block)
            else:
                self._add_call(call)

    # ---- llama3_json ---------------------------------------------------------------
    def _settle_json(self, text: str) -> None:
        """``text`` starts at the first ``{``: content up to the first object that decodes to a
        call, then calls while they follow one another, then content."""
        decoder = json.JSONDecoder()
        start = 0
        while start < len(text):
            calls, end = _json_calls(decoder, text, start)
            if calls:
                self._add_content(text[:start])
                for call in calls:
                    self._add_call(call)
                self._add_content(text[end:])
                return
            start = text.find("{", start + 1)
            if start < 0:
                break
        self._add_content(text)

    # ---- settling ------------------------------------------------------------------
    def _add_content(self, text: str) -> None:
        if self.after_call:
            text = text.lstrip()
            if not text:
                return
            self.after_call = False
        text = self.pending_space + text
        core = text.rstrip()
        self._content.append(core)
        self.pending_space = text[len(core):]

    def _add_call(self, call: ToolCall) -> None:
        self.pending_space = ""
        self.after_call = True
        self.num_calls += 1
        if self.max_calls is None or self.num_calls <= self.max_calls:
            self._calls.append(call)

    def _take(self) -> Parsed:
        parsed = Parsed("".join(self._content), self._calls)
        self._content, self._calls = [], []
        return parsed


def _json_calls(decoder: json.JSONDecoder, text: str, start: int) -> tuple[list[ToolCall], int]:
    """The calls that follow one another from ``start`` (separated by whitespace or ``;``), and
    where they end."""
    calls, position = [], start
    while position < len(text) and text[position] == "{":
        try:
            value, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            break
        call = _call_from(value, ("parameters", "arguments"))
        if call is None:
            break
        calls.append(call)
        position = end
        rest = text[end:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        if not rest.startswith("{"):
            break
        position = len(text) - len(rest)
    return calls, position


def _decode_call(body: str, keys: tuple[str, ...]) -> ToolCall | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    return _call_from(value, keys)


def _call_from(value, keys: tuple[str, ...]) -> ToolCall | None:
    """A call from a decoded ``{"name": str, <key>: object}`` (the first of ``keys`` present;
    none present: no arguments), else None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    key = next((k for k in keys if k in value), None)
    arguments = {} if key is None else value[key]
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
