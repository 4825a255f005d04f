"""Per-request sampling settings, validated on construction.

Invalid values raise ``ParamError`` (a ``ValueError``) naming the field, the value and what is allowed;
the engine never sees an invalid ``SamplingParams``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cluster.errors import ParamError
from cluster.structured.constraint import StructuredOutputs

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return besides the sampled token
    # Logprobs of the prompt's tokens (each given the tokens before it) and this many top ones
    # at each position (vLLM's prompt_logprobs); None: not computed.
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    # Keep the matched stop string, or the stop token's text (EOS, stop_token_ids), in the output
    # text; by default both are left out (the token ids keep the stop token either way).
    include_stop_str_in_output: bool = False
    # Added to the logits of these token ids before anything else (OpenAI's logit_bias).
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Only these token ids may be sampled (vLLM's allowed_token_ids); None: any.
    allowed_token_ids: list[int] | None = None
    # Words the output may never contain (vLLM's bad_words).
    bad_words: list[str] = field(default_factory=list)
    # The output must match this (JSON schema, regex, choice, grammar); None: free text.
    structured_outputs: StructuredOutputs | None = None
    # Where the request queues under scheduler.policy priority: lower first (vLLM's priority).
    priority: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.bad_words = list(self.bad_words or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, allowed: str) -> ParamError:
            return ParamError(name, f"{name} must be {allowed}, got {getattr(self, name)!r}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "an integer >= 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise bad("temperature", "a finite number >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "a non-negative integer (0 or -1 disables it)")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "in [-2, 2]")
        if not self.repetition_penalty > 0:
            raise bad("repetition_penalty", "> 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", "an integer in [0, 20] or None")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool)
                                                 or not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            raise bad("prompt_logprobs", "an integer in [0, 20] or None")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise bad("priority", "an integer (lower is served first)")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"an integer in [0, max_tokens={self.max_tokens}]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative token ids")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.logit_bias) or any(
                isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                for v in self.logit_bias.values()):
            raise bad("logit_bias", "a map of non-negative token ids to finite numbers")
        if self.allowed_token_ids is not None and (not self.allowed_token_ids or any(
                not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.allowed_token_ids)):
            raise bad("allowed_token_ids", "a non-empty list of non-negative token ids, or None")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise bad("bad_words", "a list of words (non-blank strings)")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise bad("structured_outputs", "a StructuredOutputs or None")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1.0
        )


def check_priority(params: SamplingParams, policy: str) -> None:
    """A priority other than 0 is served only under ``scheduler.policy: priority``: ParamError otherwise."""
    if params.priority != 0 and policy != "priority":
        raise ParamError("priority", f"priority is {params.priority}, but this engine serves requests first come, "
                                     "first served (priority needs scheduler.policy: priority)")
