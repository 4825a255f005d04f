"""The engine face a replica talks to: one generate request in, a stream of deltas out.

These types cross process boundaries (Ray pickles them), so they are plain
dataclasses of plain values. The ingress validates, tokenizes and settles every
parameter (``max_tokens`` included, against the group's context); the replica hands
the request to its engine and streams ``GenerateDelta``s back. The first delta of
every stream is an *acknowledgement* (``accepted`` set, no tokens): it arrives once the
engine has validated and queued the request, so the caller can still answer with a
clean HTTP error when it is ``error`` instead. A request that names a ``feed`` gets only
that acknowledgement on its own stream (which ends when the request does); its token
deltas travel in the feed, one stream per ingress and replica (``FeedRequest``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.routing.stats import RoutingRequest
from cluster.shared.outputs import SpecDecodeCounts, TokenLogprobs
from cluster.shared.sampling_params import SamplingParams


class QueueFullError(RuntimeError):
    """The engine's waiting queue is at ``max_queued_requests``; retry later."""


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    cache_salt: str | None = None
    # What the routers rank it by (built with the request at the ingress; None: not routed).
    routing: RoutingRequest | None = None
    lora: str | None = None  # the LoRA adapter it runs with (model.lora_modules; None: the base model)
    # The ingress feed its token deltas travel by (``FeedRequest.feed_id``; None: its own stream, after the ack).
    feed: str | None = None


@dataclass(frozen=True)
class FeedRequest:
    """An ingress asks one replica (``replica_id``; the router sends it there) for the token deltas of all
    its requests there that name ``feed_id``: one stream of ``[(request_id, delta), ...]`` items, each
    holding what waited since the last (a request's waiting deltas merged into one)."""

    feed_id: str
    replica_id: str


@dataclass(frozen=True)
class WarmStartRequest:
    """A starting replica (``replica_id``) asks another of its group for up to ``max_requests`` of its
    latest finished responses (the router sends it to any replica but the asker, where there is one)."""

    replica_id: str
    max_requests: int


# The code of an error that says the engine is gone or failed, not the request: the ingress may
# send a request that has streamed nothing yet to another replica.
ENGINE_UNAVAILABLE = "engine_unavailable"


@dataclass(frozen=True)
class ErrorInfo:
    """An OpenAI-style error: HTTP status, message, type and the offending parameter."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


@dataclass
class GenerateDelta:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or "grammar_dead_end" on the last delta
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # so far
    num_cached_tokens: int = 0
    accepted: bool = False  # the acknowledgement that starts every stream
    error: ErrorInfo | None = None
    replica_stats: dict | None = None  # ReplicaStats.to_dict() of the serving replica, on the acknowledgement
    replica_id: str | None = None  # the replica that answered, on the acknowledgement or refusal
    # With prompt_logprobs, on the first token delta: per prompt token (None for the first)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # On the last delta: the request's speculative decoding (None: its engine does not count it per request)
    spec_decode: SpecDecodeCounts | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


def merge_deltas(first: GenerateDelta, second: GenerateDelta) -> GenerateDelta:
    """One token delta carrying two consecutive ones of the same request (for a reader
    that fell behind): text, tokens and logprobs joined, the counts and end of the later."""
    logprobs = None
    if first.logprobs is not None or second.logprobs is not None:
        logprobs = (first.logprobs or []) + (second.logprobs or [])
    return GenerateDelta(
        text=first.text + second.text,
        token_ids=first.token_ids + second.token_ids,
        logprobs=logprobs,
        finish_reason=second.finish_reason,
        stop_reason=second.stop_reason,
        num_prompt_tokens=second.num_prompt_tokens,
        num_output_tokens=second.num_output_tokens,
        num_cached_tokens=second.num_cached_tokens,
        error=second.error,
        prompt_logprobs=first.prompt_logprobs if first.prompt_logprobs is not None else second.prompt_logprobs,
        spec_decode=second.spec_decode if second.spec_decode is not None else first.spec_decode,
    )
