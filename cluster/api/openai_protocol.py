"""OpenAI request bodies as pydantic models, and their translation to SamplingParams.

Known fields are type-checked strictly (a string where a number belongs is a 400, not
a silent conversion); unknown fields are ignored, as OpenAI and vLLM do. Fields that
OpenAI defines but Tandem does not implement are rejected with a message naming them
rather than silently ignored. Tandem also accepts vLLM's extra sampling fields
(``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``,
``stop_token_ids``, ``skip_special_tokens``), ``cache_salt`` and ``structured_outputs``.

Output constraints (``response_format``, ``structured_outputs``) are mapped in
``structured_request``; the tool fields in ``tool_request``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from cluster.api.errors import UnsupportedFieldError
from cluster.api.structured_request import (
    ResponseFormat,
    StructuredOutputsField,
    response_format_constraint,
    single_constraint,
    structured_outputs_constraint,
)
from cluster.api.tool_request import NO_TOOLS, ToolChoice, ToolPlan, ToolSpec, plan_tools
from cluster.shared.sampling_params import SamplingParams
from cluster.structured.constraint import StructuredOutputs

__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest", "UnsupportedFieldError"]

MAX_N = 16


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _SamplingFields(_Body):
    model: StrictStr
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    user: StrictStr | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: StrictInt | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(0, ge=0)
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool = True
    cache_salt: StrictStr | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None

    def check_supported(self) -> None:
        if self.logit_bias:
            raise UnsupportedFieldError("logit_bias", "logit_bias is not supported by Tandem")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedFieldError("stream_options", "stream_options is only allowed when stream is true")

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def output_constraint(self) -> StructuredOutputs | None:
        """What ``response_format`` / ``structured_outputs`` ask the output to match (raises
        UnsupportedFieldError or ConstraintError naming the field)."""
        return single_constraint(("response_format", response_format_constraint(self.response_format)),
                                 ("structured_outputs", structured_outputs_constraint(self.structured_outputs)))

    def sampling_params(self, max_tokens: int, num_logprobs: int | None, choice: int,
                        structured_outputs: StructuredOutputs | None = None) -> SamplingParams:
        """``max_tokens``: resolved (``engine_requests.resolved_max_tokens``); a default one
        caps ``min_tokens`` instead of making it invalid. Raises ValueError (from
        SamplingParams) naming the offending field."""
        defaulted = self.requested_max_tokens() is None
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        seed = None if self.seed is None else self.seed + choice
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=num_logprobs,
            min_tokens=min(self.min_tokens, max_tokens) if defaulted else self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=structured_outputs,
        )


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise UnsupportedFieldError("echo", "echo is not supported by Tandem")
        if self.suffix:
            raise UnsupportedFieldError("suffix", "suffix is not supported by Tandem")
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedFieldError("best_of", "best_of other than n is not supported by Tandem")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt of a batched request."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise UnsupportedFieldError("prompt", "prompt is empty; send a string or a list of token ids")
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(_Body):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class MessageToolCall(_Body):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages
    tool_call_id: StrictStr | None = None  # tool messages: the call this is the result of

    @model_validator(mode="after")
    def _check_tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages may carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def as_template_message(self) -> dict:
        """The message as chat templates take it: developer becomes system, content a string
        (None: empty), tool_calls and tool_call_id kept where set."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        message = {"role": role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    functions: list | None = None  # OpenAI's deprecated forms of tools
    function_call: StrictStr | dict | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for old, new in (("functions", "tools"), ("function_call", "tool_choice")):
            if getattr(self, old) is not None:
                raise UnsupportedFieldError(old, f"{old} (deprecated by OpenAI) is not supported; use {new}")
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedFieldError("top_logprobs", "top_logprobs needs logprobs set to true")

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def tool_plan(self, tool_format: str) -> ToolPlan:
        """What the tool fields ask for under the model's tool-call format (raises naming the field)."""
        return plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls, tool_format)

    def chat_constraint(self, plan: ToolPlan = NO_TOOLS) -> StructuredOutputs | None:
        """The one output constraint of the request: response_format, structured_outputs or a forced call."""
        return single_constraint(("response_format", response_format_constraint(self.response_format)),
                                 ("structured_outputs", structured_outputs_constraint(self.structured_outputs)),
                                 ("tool_choice", plan.constraint))
