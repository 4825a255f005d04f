"""OpenAI's Responses API (``POST /v1/responses``): the request body, and the chat request it is served as.

A response is what the assistant says next after ``input`` (a string, or a list of items:
messages whose content is text, and the ``function_call`` / ``function_call_output`` items of
earlier tool calls) and ``instructions`` (a system message). It is served as the chat completion
of those messages (``as_chat_request``), so it shares the chat path's template, sampling,
structured outputs (``text.format``), function tools (flat ``{"type": "function", "name", ...}``
specs, ``tool_choice``) and routing. With ``previous_response_id`` the messages start from that
stored response's context (``cluster/api/response_store.py``): its input and output, and those of
the responses it continued, but not their instructions. ``include: ["message.output_text.logprobs"]``
asks for the output tokens' logprobs (with ``top_logprobs`` alternatives each, 0 to 20), served as
the chat request's ``logprobs``. What this server does not keep or run is refused with a 400 naming
the field: conversations, background responses, stored prompts, built-in tools, reasoning
settings, and any other ``include``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from cluster.api.errors import UnsupportedFieldError
from cluster.api.openai_protocol import ChatCompletionRequest

_ROLES = ("user", "assistant", "system", "developer")
OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the one ``include`` value served
_TEXT_PARTS = ("input_text", "output_text", "text")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: StrictBool | None = None
    description: StrictStr | None = None


class TextOptions(_Body):
    format: TextFormat | None = None
    verbosity: Any = None


class ResponsesRequest(_Body):
    model: StrictStr
    input: StrictStr | list[dict]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: StrictBool = False
    store: StrictBool = True
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None
    text: TextOptions | None = None
    truncation: Literal["auto", "disabled"] | None = None
    parallel_tool_calls: StrictBool | None = None
    tool_choice: Any = None  # checked by chat_tool_choice
    tools: Any = None  # function tools only, checked by chat_tools
    previous_response_id: StrictStr | None = None
    # Refused unless empty (see the module's docstring), of any type so the 400 names them.
    conversation: Any = None
    background: Any = None
    reasoning: Any = None
    include: Any = None  # checked by check_supported: a list holding OUTPUT_LOGPROBS at most
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    prompt: Any = None
    # vLLM's sampling extras, as on the other routes
    top_k: StrictInt | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: StrictInt | None = None
    priority: StrictInt = 0  # vLLM's, as on the other routes (scheduler.policy priority)

    def check_supported(self) -> None:
        for name, what in (("conversation", "conversations (continue a response with previous_response_id)"),
                           ("background", "background responses"), ("prompt", "stored prompts")):
            if getattr(self, name) not in (None, False):
                raise UnsupportedFieldError(name, f"{name} is not supported: this server keeps no {what}")
        if self.reasoning not in (None, {}):
            raise UnsupportedFieldError("reasoning", "reasoning settings are not supported for this model")
        if self.include is not None:
            others = self.include if not isinstance(self.include, list) else \
                [item for item in self.include if item != OUTPUT_LOGPROBS]
            if others:
                raise UnsupportedFieldError("include", f"include may hold {OUTPUT_LOGPROBS!r} only (got {others!r})")

    def wants_logprobs(self) -> bool:
        return isinstance(self.include, list) and OUTPUT_LOGPROBS in self.include

    def messages(self, context: list[dict] = ()) -> list[dict]:
        """The chat messages: ``instructions`` as a system message, then the ``context`` items of the
        previous response, then ``input`` (a function call joins the assistant message before it, or
        starts one; its output is a tool message)."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            items = [{"role": "user", "content": self.input}]
        elif not self.input:
            raise UnsupportedFieldError("input", "input is empty; send a string or at least one message")
        else:
            items = self.input
        for position, item in enumerate([*context, *items], start=-len(context)):
            kind = item.get("type", "message")
            if kind == "function_call":
                call = _function_call(item, position)
                if messages and messages[-1]["role"] == "assistant":
                    messages[-1].setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                messages.append(_function_output(item, position))
            else:
                messages.append(_message(item, position))
        return messages

    def chat_tools(self) -> list[dict] | None:
        """``tools`` in the chat shape (function tools only)."""
        if not self.tools:
            return None
        if not isinstance(self.tools, list):
            raise UnsupportedFieldError("tools", "tools must be a list of function tools")
        tools = []
        for position, tool in enumerate(self.tools):
            if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
                kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
                raise UnsupportedFieldError("tools", f"tools[{position}]: only function tools with a name are "
                                                     f"served, got {kind!r}")
            function = {key: tool[key] for key in ("name", "description", "parameters", "strict")
                        if tool.get(key) is not None}
            tools.append({"type": "function", "function": function})
        return tools

    def chat_tool_choice(self):
        """``tool_choice`` in the chat shape."""
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto", "required"):
            return choice
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        raise UnsupportedFieldError("tool_choice", "tool_choice must be none, auto, required or "
                                                   f'{{"type": "function", "name": ...}}, got {choice!r}')

    def response_format(self) -> dict | None:
        """``text.format`` as chat's ``response_format``."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        if fmt.schema_ is None:
            raise UnsupportedFieldError("text", "text.format of type json_schema needs a schema")
        schema = {"name": fmt.name or "response", "schema": fmt.schema_}
        if fmt.strict is not None:
            schema["strict"] = fmt.strict
        return {"type": "json_schema", "json_schema": schema}

    def as_chat_request(self, context: list[dict] = ()) -> ChatCompletionRequest:
        """The chat completion this response is served as (one choice, never streamed itself), after
        the previous response's ``context``."""
        body = {"model": self.model, "messages": self.messages(context), "max_completion_tokens": self.max_output_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "response_format": self.response_format(),
                "top_k": self.top_k, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
                "seed": self.seed, "tools": self.chat_tools(), "tool_choice": self.chat_tool_choice(),
                "parallel_tool_calls": self.parallel_tool_calls, "priority": self.priority or None}
        if self.wants_logprobs():
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})


def _function_call(item: dict, position: int) -> dict:
    """A ``function_call`` input item as a chat tool call."""
    fields = {key: item.get(key) for key in ("call_id", "name", "arguments")}
    if not all(isinstance(value, str) for value in fields.values()):
        raise UnsupportedFieldError("input", f"input[{position}]: a function_call needs call_id, name and "
                                             "arguments (strings)")
    return {"id": fields["call_id"], "type": "function",
            "function": {"name": fields["name"], "arguments": fields["arguments"]}}


def _function_output(item: dict, position: int) -> dict:
    """A ``function_call_output`` input item as a chat tool message."""
    output = item.get("output")
    if isinstance(output, list):
        output = _text(output, f"input[{position}].output")
    if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
        raise UnsupportedFieldError("input", f"input[{position}]: a function_call_output needs call_id and output "
                                             "(text)")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}


def _message(item: dict, position: int) -> dict:
    """One input item as a chat message (text content only)."""
    where = f"input[{position}]"
    if item.get("type", "message") != "message":
        raise UnsupportedFieldError("input", f"{where}: items of type {item.get('type')!r} are not supported; "
                                             "send messages with text content")
    role = item.get("role")
    if role not in _ROLES:
        raise UnsupportedFieldError("input", f"{where}: role must be one of {', '.join(_ROLES)}, got {role!r}")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise UnsupportedFieldError("input", f"{where}: content must be a string or a list of text parts")
    return {"role": role, "content": _text(content, where)}


def _text(parts: list, where: str) -> str:
    """Text content parts joined (any other kind refused)."""
    texts = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise UnsupportedFieldError("input", f"{where}: content parts must be text ({', '.join(_TEXT_PARTS)}), "
                                                 f"got {kind!r}")
        texts.append(part["text"])
    return "".join(texts)
