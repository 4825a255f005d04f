"""Per-request records and the summary metrics of ``tandem bench serve`` (vLLM's definitions).

Per request (times in seconds from the moment the request was sent):

* TTFT: arrival of the first streamed chunk that carries text;
* ITL: the gaps between consecutive chunks that carry text. A chunk with several
  tokens (speculative decoding emits them) is one gap, so ITL is per chunk;
* E2E latency: until the stream ended;
* TPOT = (E2E - TTFT) / (output tokens - 1), only for requests with more than one
  output token, so it is per token;
* output tokens: ``usage.completion_tokens`` of the last chunk that had ``usage``,
  else the number of chunks that carried text.

Summary over the successful requests, ``duration`` being the benchmark's wall time:
request throughput = completed / duration; output token throughput = output tokens /
duration; total token throughput = (prompt + output tokens) / duration; mean, median,
standard deviation and the chosen percentiles (numpy's linear interpolation) of each
latency in milliseconds (``None`` when there is no sample, e.g. no TPOT when every
output had one token); goodput = requests meeting every given SLO / duration, where a
request without a TPOT counts as TPOT 0 (as vLLM does).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


@dataclass(frozen=True)
class RequestRecord:
    """What one request did. A successful request has at least one content chunk."""

    index: int  # position in the workload
    scheduled_s: float  # planned send time, seconds since the benchmark start
    start_s: float  # actual send time (after any concurrency wait), seconds since the benchmark start
    success: bool
    error: str  # "" on success
    prompt_len: int  # the workload's estimate (words)
    output_len: int  # max_tokens sent
    prompt_tokens: int  # usage.prompt_tokens, else prompt_len
    output_tokens: int
    output_tokens_source: str  # "usage" or "chunks"
    e2e_s: float
    chunk_times_s: tuple[float, ...]  # arrival of every content chunk, since start_s

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] if self.chunk_times_s else None

    @property
    def itl_s(self) -> list[float]:
        times = self.chunk_times_s
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens <= 1 or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict:
        return {**asdict(self), "chunk_times_s": list(self.chunk_times_s), "ttft_s": self.ttft_s,
                "tpot_s": self.tpot_s, "itl_s": self.itl_s}


def percentile_key(p: float) -> str:
    """``99 -> "p99"``, ``99.9 -> "p99.9"`` (vLLM's spelling)."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def parse_percentiles(text: str) -> tuple[float, ...]:
    """``"50,90,99"`` -> ``(50.0, 90.0, 99.0)``; each must be in [0, 100]."""
    try:
        values = tuple(float(s) for s in text.split(","))
    except ValueError:
        values = ()
    if not values or not all(0 <= v <= 100 for v in values):
        raise ValueError(f"expected percentiles in [0, 100] like 50,90,99, got {text!r}")
    return values


def parse_goodput(pairs: list[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if not sep or name not in SLO_METRICS or not 0 <= ms < math.inf:
            raise ValueError(f"bad goodput SLO {pair!r}: expected NAME:MILLISECONDS with NAME one of "
                             f"{', '.join(SLO_METRICS)} and a number >= 0, e.g. ttft:500 tpot:50")
        slos[name] = ms
    return slos


def _describe(name: str, values_s: list[float], percentiles, np) -> dict:
    ms = np.asarray(values_s, dtype=float) * 1e3
    stats = {f"mean_{name}_ms": None, f"median_{name}_ms": None, f"std_{name}_ms": None}
    stats.update({f"{percentile_key(p)}_{name}_ms": None for p in percentiles})
    if ms.size:
        stats.update({f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
                      f"std_{name}_ms": float(ms.std())})
        stats.update({f"{percentile_key(p)}_{name}_ms": float(np.percentile(ms, p)) for p in percentiles})
    return stats


def _is_good(record: RequestRecord, slos: dict[str, float]) -> bool:
    measured_ms = {"ttft": record.ttft_s * 1e3, "tpot": (record.tpot_s or 0.0) * 1e3, "e2el": record.e2e_s * 1e3}
    return all(measured_ms[name] <= limit for name, limit in slos.items())


def max_concurrency_seen(records: list[RequestRecord]) -> int:
    """The most successful requests in flight at once (send to end of stream)."""
    return peak_overlap([(r.start_s, r.start_s + r.e2e_s) for r in records])


def peak_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most ``[start, end)`` intervals open at one time (an end before a start at the same instant)."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    best = now = 0
    for _, step in events:
        now += step
        best = max(best, now)
    return best


def summarize(records: list[RequestRecord], duration: float, goodput_slos: dict[str, float] | None = None,
              percentiles=DEFAULT_PERCENTILES) -> dict:
    """The summary dict (keys as in vLLM's result JSON, plus ``failed``); see the module docstring.
    ``duration`` is in seconds and must be > 0; ``goodput_slos`` maps ttft/tpot/e2el to milliseconds."""
    if not duration > 0:
        raise ValueError(f"the benchmark duration must be > 0 s, got {duration}")
    unknown = set(goodput_slos or {}) - set(SLO_METRICS)
    if unknown:
        raise ValueError(f"unknown goodput SLO metric(s) {sorted(unknown)}; allowed: {', '.join(SLO_METRICS)}")
    ok = [r for r in records if r.success]
    total_input = sum(r.prompt_tokens for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    summary = {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "request_goodput": None,
        "good_requests": None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "max_concurrent_requests": max_concurrency_seen(ok),
        "percentiles": list(percentiles),
        "goodput_slos_ms": dict(goodput_slos or {}),
    }
    if goodput_slos:
        good = sum(_is_good(r, goodput_slos) for r in ok)
        summary.update(good_requests=good, request_goodput=good / duration)
    summary.update(_describe("ttft", [r.ttft_s for r in ok], percentiles, np))
    summary.update(_describe("tpot", [r.tpot_s for r in ok if r.tpot_s is not None], percentiles, np))
    summary.update(_describe("itl", [gap for r in ok for gap in r.itl_s], percentiles, np))
    summary.update(_describe("e2el", [r.e2e_s for r in ok], percentiles, np))
    return summary
