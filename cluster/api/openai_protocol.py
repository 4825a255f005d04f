"""OpenAI request bodies as pydantic models, and their translation to SamplingParams.

Known fields are type-checked strictly (a string where a number belongs is a 400, not
a silent conversion); unknown fields are ignored, as OpenAI and vLLM do. Fields that
OpenAI defines but Tandem does not implement are rejected with a message naming them
rather than silently ignored. Tandem also accepts vLLM's extra sampling fields
(``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``,
``stop_token_ids``, ``skip_special_tokens``, ``include_stop_str_in_output``,
``allowed_token_ids``, ``bad_words``, ``prompt_logprobs``), its response fields
(``return_token_ids``, ``return_tokens_as_token_ids``; Tandem's ``return_spec_decode_metrics`` asks for
vLLM's per-request ``metrics.speculative_decoding``), its prompt
fields (``truncate_prompt_tokens``, ``add_special_tokens``; on chat ``add_generation_prompt``,
``continue_final_message``, ``chat_template_kwargs``), ``cache_salt`` and ``structured_outputs``.
A ``chat_template`` in the request is refused, as vLLM's server does unless told to trust
it: the server renders with the model's. vLLM's extras that Tandem does not implement
(``VLLM_UNSUPPORTED``) are refused when set to anything but their default, since ignoring
them would change the answer silently. The bodies of vLLM's ``/tokenize`` and
``/detokenize`` are here too.

Output constraints (``response_format``, ``structured_outputs``) are mapped in
``structured_request``; the tool fields in ``tool_request``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

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

__all__ = ["ChatCompletionRequest", "ChatMessage", "ChatPromptFields", "CompletionRequest", "DetokenizeRequest",
           "TokenizeChatRequest", "TokenizeCompletionRequest", "UnsupportedFieldError"]

MAX_N = 16
# vLLM's request fields that Tandem does not implement, with the values that ask for nothing.
VLLM_UNSUPPORTED = {
    "use_beam_search": (False,),
    "logits_processors": (None, []),
}
# apply_chat_template's own arguments, which chat_template_kwargs may not set.
_RENDER_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: with include_usage, every chunk carries its choice's usage


class _SamplingFields(_Body):
    model: StrictStr
    max_tokens: StrictInt | None = Field(None, ge=0)  # 0: only with a completion's echo
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
    include_stop_str_in_output: StrictBool = False
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[StrictStr] | None = None
    truncate_prompt_tokens: StrictInt | None = Field(None, ge=-1)
    cache_salt: StrictStr | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    prompt_logprobs: StrictInt | None = None
    return_token_ids: StrictBool = False  # the output's token ids in each choice, the prompt's beside them
    return_tokens_as_token_ids: StrictBool | None = None  # logprobs name tokens "token_id:N", not by their text
    # vLLM's per-request speculation figures (its server's --per-request-spec-decode-metrics) for this request
    return_spec_decode_metrics: StrictBool = False
    priority: StrictInt = 0  # where it queues under the engine's scheduler.policy priority (lower first)
    # VLLM_UNSUPPORTED, of any type: kept only to be refused by name
    use_beam_search: Any = False
    logits_processors: Any = None

    def check_supported(self) -> None:
        for name, defaults in VLLM_UNSUPPORTED.items():
            value = getattr(self, name)
            if not any(value is d or (type(value) is type(d) and value == d) for d in defaults):
                raise UnsupportedFieldError(name, f"{name} is not supported by Tandem (got {value!r})")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedFieldError("stream_options", "stream_options is only allowed when stream is true")
        if self.max_tokens == 0 and not self.echo_only:
            raise UnsupportedFieldError("max_tokens", "max_tokens must be at least 1 (0 is allowed only with echo "
                                                      "on /v1/completions, for the prompt alone)")
        if self.prompt_logprobs is not None:
            if not 0 <= self.prompt_logprobs <= 20:
                raise UnsupportedFieldError("prompt_logprobs", "prompt_logprobs must be an integer in [0, 20] "
                                            f"(the top logprobs at each prompt position), got {self.prompt_logprobs}")
            if self.stream and self.prompt_logprobs > 0:  # as vLLM: no chunk has a place for them
                raise UnsupportedFieldError("prompt_logprobs", "prompt_logprobs are not available when stream is "
                                                               "true")

    @property
    def echo_only(self) -> bool:
        """The response is the prompt alone (a completion's ``echo`` with ``max_tokens`` 0)."""
        return False

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_prompt_logprobs(self) -> int | None:
        """How many top logprobs to compute at each prompt position (None: none)."""
        return self.prompt_logprobs

    def token_bias(self) -> dict[int, float]:
        """``logit_bias`` keyed by token id, each bias clamped to OpenAI's [-100, 100] (as vLLM does)."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise UnsupportedFieldError("logit_bias", f"logit_bias keys must be token ids, got {key!r}") from None
            if not math.isfinite(value):
                raise UnsupportedFieldError("logit_bias", f"logit_bias values must be finite numbers, got {value!r}")
            bias[token] = min(100.0, max(-100.0, value))
        return bias

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
            prompt_logprobs=self.requested_prompt_logprobs(),
            min_tokens=min(self.min_tokens, max_tokens) if defaulted else self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.token_bias(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=list(self.bad_words or []),
            structured_outputs=structured_outputs,
            priority=self.priority,
        )


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None
    add_special_tokens: StrictBool = True  # the tokenizer's BOS and the like, around each text prompt

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise UnsupportedFieldError("suffix", "suffix is not supported by Tandem")
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedFieldError("best_of", "best_of other than n is not supported by Tandem")

    @property
    def echo_only(self) -> bool:
        return self.echo and self.max_tokens == 0

    def requested_max_tokens(self) -> int | None:
        # The prompt alone still runs one step (as vLLM): its logprobs come with the first token.
        return 1 if self.echo_only else self.max_tokens

    def requested_prompt_logprobs(self) -> int | None:
        """``echo`` with ``logprobs`` returns the prompt's logprobs with the output's (as vLLM)."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

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


class ChatPromptFields(_Body):
    """How chat messages become a prompt (chat completions and ``/tokenize``)."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    # vLLM's chat extras
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False  # the template already writes them
    chat_template: Any = None  # refused: see the module's docstring
    chat_template_kwargs: dict[str, object] | None = None

    def check_prompt_fields(self) -> None:
        if self.chat_template is not None:
            raise UnsupportedFieldError("chat_template", "a chat_template in the request is not accepted; the server "
                                        "renders messages with the model's own template")
        if self.continue_final_message and self.add_generation_prompt:
            raise UnsupportedFieldError("continue_final_message", "continue_final_message and add_generation_prompt "
                                        "cannot both be true (add_generation_prompt defaults to true)")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise UnsupportedFieldError("continue_final_message", "continue_final_message needs the last message "
                                        f"to be the assistant's, got {self.messages[-1].role!r}")
        reserved = sorted(_RENDER_ARGUMENTS & set(self.chat_template_kwargs or {}))
        if reserved:
            raise UnsupportedFieldError("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(reserved)}"
                                        " (request fields or the renderer's own arguments)")

    def template_options(self) -> dict:
        """What ``apply_chat_template`` is given besides the messages and tools."""
        return {**(self.chat_template_kwargs or {}), "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}


class ChatCompletionRequest(_SamplingFields, ChatPromptFields):
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    functions: list | None = None  # OpenAI's deprecated forms of tools
    function_call: StrictStr | dict | None = None
    echo: StrictBool = False

    def check_supported(self) -> None:
        super().check_supported()
        self.check_prompt_fields()
        for old, new in (("functions", "tools"), ("function_call", "tool_choice")):
            if getattr(self, old) is not None:
                raise UnsupportedFieldError(old, f"{old} (deprecated by OpenAI) is not supported; use {new}")
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedFieldError("top_logprobs", "top_logprobs needs logprobs set to true")

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_prompt_logprobs(self) -> int | None:
        """``echo`` with ``top_logprobs`` also returns the prompt's logprobs (as vLLM)."""
        if self.prompt_logprobs is None and self.echo:
            return self.top_logprobs
        return self.prompt_logprobs

    def echo_text(self) -> str:
        """What ``echo`` puts before the reply: the last message's content, when that message is the
        reply's own (the assistant's; any role with ``add_generation_prompt`` false), as vLLM does."""
        last = self.messages[-1]
        if self.add_generation_prompt and last.role != "assistant":
            return ""
        return last.as_template_message()["content"]

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


# ---- vLLM's tokenizer routes ---------------------------------------------------------
class TokenizeCompletionRequest(_Body):
    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(ChatPromptFields):
    model: StrictStr | None = None
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Body):
    model: StrictStr | None = None
    tokens: list[StrictInt]
