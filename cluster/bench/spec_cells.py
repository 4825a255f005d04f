"""The cells of ``tandem bench spec``: one (system, batch size, k) run each, from per-request timings.

Shared by :mod:`cluster.bench.spec` and :mod:`cluster.bench.paper_sweep`, so both are summed up
alike: output tok/s over wall time, TPOT per request as vLLM defines it ((last token time - first
token time) / (output tokens - 1)), TTFT, and the speculative counters over the timed run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

WARMUP_LEN = 8  # output tokens of each cell's untimed warm-up requests


@dataclass(frozen=True)
class RequestTiming:
    ttft_s: float  # from submission to the first output token
    decode_s: float  # from the first output token to the last
    output_tokens: int
    decode_steps: int | None = None  # target steps that emitted tokens after the first (Tandem only)


@dataclass(frozen=True)
class SpecCounts:
    """Speculative decoding counters (vLLM's meanings); differences give one run's share."""

    num_drafts: int = 0  # request-steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()

    @classmethod
    def of(cls, stats) -> SpecCounts:
        return cls(stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                   tuple(stats.accepted_per_position))

    def plus(self, other: SpecCounts) -> SpecCounts:
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        pad = lambda c: c.accepted_per_position + (0,) * (width - len(c.accepted_per_position))  # noqa: E731
        return SpecCounts(self.num_drafts + other.num_drafts, self.num_draft_tokens + other.num_draft_tokens,
                          self.num_accepted_tokens + other.num_accepted_tokens,
                          tuple(a + b for a, b in zip(pad(self), pad(other))))

    def minus(self, earlier: SpecCounts) -> SpecCounts:
        width = len(self.accepted_per_position)
        old = earlier.accepted_per_position + (0,) * (width - len(earlier.accepted_per_position))
        return SpecCounts(self.num_drafts - earlier.num_drafts, self.num_draft_tokens - earlier.num_draft_tokens,
                          self.num_accepted_tokens - earlier.num_accepted_tokens,
                          tuple(a - b for a, b in zip(self.accepted_per_position, old)))


# The k of a cell run by the adaptive controller (``--adaptive``), which picks k itself every step.
ADAPTIVE_K = -1


def k_name(k: int) -> str:
    """How a cell's k is printed."""
    return "adaptive" if k == ADAPTIVE_K else str(k)


@dataclass(frozen=True)
class SpecCell:
    """One (system, batch size, k) run over all prompts."""

    system: str  # "tandem" or "vllm"
    method: str
    batch_size: int
    k: int  # ADAPTIVE_K for the adaptive controller's cell
    num_requests: int
    output_tokens: int
    seconds: float
    tok_per_s: float
    tpot_ms: float | None  # mean over requests
    ttft_ms: float  # mean over requests
    tokens_per_step: float | None  # output tokens per target step after the first token
    num_drafts: int | None = None
    num_draft_tokens: int | None = None
    num_accepted_tokens: int | None = None
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    accepted_per_position: list[int] = field(default_factory=list)
    identical_to_k0: int | None = None  # requests whose tokens equal k = 0's at this batch size
    repeat_tok_per_s: list[float] = field(default_factory=list)  # each round's tok/s (--repeats)


def pool_rounds(system: str, method: str, batch_size: int, k: int, output_len: int,
                rounds: list[tuple[list[RequestTiming], float, SpecCounts]]) -> SpecCell:
    """One cell from its rounds' (timings, seconds, counts): every round's requests and
    counters together, tok/s as all rounds' tokens over all rounds' seconds, and each
    round's own tok/s in ``repeat_tok_per_s``."""
    counts = rounds[0][2]
    for _, _, more in rounds[1:]:
        counts = counts.plus(more)
    cell = make_cell(system, method, batch_size, k, output_len, [t for r in rounds for t in r[0]],
                     sum(r[1] for r in rounds), counts)
    return dataclasses.replace(cell, repeat_tok_per_s=[sum(t.output_tokens for t in r[0]) / r[1] for r in rounds])


def make_cell(system: str, method: str, batch_size: int, k: int, output_len: int,
              timings: list[RequestTiming], seconds: float, counts: SpecCounts | None) -> SpecCell:
    """Raises RuntimeError if any request did not produce exactly ``output_len`` tokens."""
    wrong = [t.output_tokens for t in timings if t.output_tokens != output_len]
    if wrong:
        raise RuntimeError(f"{system} produced {wrong[:3]} tokens for some requests, expected {output_len} each")
    output_tokens = sum(t.output_tokens for t in timings)
    tpots = [t.decode_s / (t.output_tokens - 1) for t in timings if t.output_tokens > 1]
    steps = [t.decode_steps for t in timings]
    per_step = (sum(t.output_tokens - 1 for t in timings) / sum(steps)
                if None not in steps and sum(steps) else None)
    spec = {}
    if counts is not None:
        spec = dict(num_drafts=counts.num_drafts, num_draft_tokens=counts.num_draft_tokens,
                    num_accepted_tokens=counts.num_accepted_tokens,
                    accepted_per_position=list(counts.accepted_per_position))
        if counts.num_draft_tokens:
            spec["acceptance_rate"] = counts.num_accepted_tokens / counts.num_draft_tokens
        if counts.num_drafts:
            spec["mean_acceptance_length"] = 1 + counts.num_accepted_tokens / counts.num_drafts
    return SpecCell(system, method, batch_size, k, len(timings), output_tokens, seconds, output_tokens / seconds,
                    sum(tpots) / len(tpots) * 1e3 if tpots else None,
                    sum(t.ttft_s for t in timings) / len(timings) * 1e3, per_step, **spec)
