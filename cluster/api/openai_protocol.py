"""OpenAI request bodies as pydantic models, and their translation to SamplingParams.

Known fields are type-checked strictly (a string where a number belongs is a 400, not
a silent conversion); unknown fields are ignored, as OpenAI and vLLM do. Fields that
OpenAI defines but Tandem does not implement are rejected with a message naming them
rather than silently ignored. Tandem also accepts vLLM's extra sampling fields
(``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``,
``stop_token_ids``, ``skip_special_tokens``) and ``cache_salt``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from cluster.engine.sampling_params import SamplingParams

MAX_N = 16


class UnsupportedFieldError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


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

    def check_supported(self) -> None:
        if self.logit_bias:
            raise UnsupportedFieldError("logit_bias", "logit_bias is not supported by Tandem")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedFieldError("stream_options", "stream_options is only allowed when stream is true")

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(self, default_max_tokens: int, num_logprobs: int | None, choice: int) -> SamplingParams:
        """Raises ValueError (from SamplingParams) naming the offending field."""
        max_tokens = self.requested_max_tokens()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        seed = None if self.seed is None else self.seed + choice
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
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
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
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


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def as_template_message(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    tools: list | None = None
    response_format: dict | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise UnsupportedFieldError("tools", "tool calling is not supported by Tandem")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise UnsupportedFieldError("response_format", "only response_format type 'text' is supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedFieldError("top_logprobs", "top_logprobs needs logprobs set to true")

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
