"""What the engine hands back to callers after each step."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


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
class SpecDecodeCounts:
    """A request's speculative decoding so far, counted as the engine's ``SpecDecodeStats`` counts
    the replica's (summed over its requests they give ``num_drafts``, ``num_draft_tokens`` and
    ``num_accepted_tokens``): the steps that verified at least one draft token of it, the draft
    tokens proposed and verified, and the ones accepted. ``acceptance_histogram[j]`` is the number
    of those steps that accepted exactly ``j`` drafts; it runs up to the largest ``k`` any step
    asked of it (empty: never asked). Immutable: a step makes a new one (``add_step``)."""

    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    acceptance_histogram: tuple[int, ...] = ()

    def add_step(self, num_asked: int, num_proposed: int, num_accepted: int) -> SpecDecodeCounts:
        """These counts after one verification that asked ``num_asked`` draft positions of the request,
        got ``num_proposed`` from the proposer and accepted the first ``num_accepted``."""
        histogram = list(self.acceptance_histogram)
        if len(histogram) <= num_asked:
            histogram.extend([0] * (num_asked + 1 - len(histogram)))
        if num_proposed == 0:  # nothing verified: not a step with drafts (as the replica's counters)
            return replace(self, acceptance_histogram=tuple(histogram))
        histogram[num_accepted] += 1
        return SpecDecodeCounts(self.num_spec_steps + 1, self.num_draft_tokens + num_proposed,
                                self.num_accepted_tokens + num_accepted, tuple(histogram))

    def __add__(self, other: SpecDecodeCounts) -> SpecDecodeCounts:
        """Two requests' counts together (the choices of one API request)."""
        size = max(len(self.acceptance_histogram), len(other.acceptance_histogram))
        ours = list(self.acceptance_histogram) + [0] * (size - len(self.acceptance_histogram))
        theirs = list(other.acceptance_histogram) + [0] * (size - len(other.acceptance_histogram))
        return SpecDecodeCounts(self.num_spec_steps + other.num_spec_steps,
                                self.num_draft_tokens + other.num_draft_tokens,
                                self.num_accepted_tokens + other.num_accepted_tokens,
                                tuple(a + b for a, b in zip(ours, theirs)))

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per verification step with drafts: 1 + accepted / steps (None: no such step)."""
        return 1 + self.num_accepted_tokens / self.num_spec_steps if self.num_spec_steps else None

    @property
    def draft_acceptance_rate(self) -> float | None:
        """Accepted over proposed draft tokens (None: none proposed)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


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
    spec_decode: SpecDecodeCounts = SpecDecodeCounts()  # its speculative decoding so far (zeros without)
