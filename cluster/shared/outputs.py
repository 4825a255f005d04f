"""What the engine hands back to callers after each step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


# One entry per generated token: token id -> its Logprob (the sampled one plus the top-n).
TokenLogprobs = dict[int, Logprob]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class CompletionOutput:
    """Cumulative text/tokens so far, plus the delta produced by the latest step.

    ``text`` never contains a stop string nor the characters that might still turn
    into one; those are held back until they cannot.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestTimes:
    """When a request arrived, was first scheduled and got its first token (``time.monotonic()``)."""

    arrival_time: float
    scheduled_time: float | None = None
    first_token_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    usage: Usage
    times: RequestTimes | None = None
    # With ``prompt_logprobs``: per prompt token, its logprob given the tokens before it and the
    # top ones (None for the first token). Outputs of delta streams carry it on the first only.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    max_tokens: int | None = None  # the request's max_tokens (the metrics' request_params_max_tokens)
    num_preemptions: int = 0  # how often it was preempted so far
