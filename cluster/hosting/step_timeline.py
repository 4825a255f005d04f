"""The engine core's recent steps on a clock, for seeing where serving time goes.

Each loop of the core (``core.py``) records one ``TimelineEntry``: when it began,
how long it waited for work (idle), took messages from the replica, stepped (and of that,
the runner's forward pass and sampling), and sent the step's message. ``summary`` turns a
window of entries into the figures the served-path benchmark reports: the share of wall
time the engine was stepping, the mean batch and tokens per step, the time per step
spent in Python around the forward pass, and the steps split by what they carried (a
prompt's chunk or only decodes; drafts to verify or none). ``GET /debug/timeline`` shows it
for a replica.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class TimelineEntry:
    started: float  # time.monotonic() when the loop began waiting for or taking messages
    idle_seconds: float  # blocked with nothing to do
    receive_seconds: float  # taking the replica's messages (adds, aborts, calls)
    step_seconds: float  # Engine.step, 0 when the loop did not step
    execute_seconds: float  # of the step: the runner's forward pass and sampling
    send_seconds: float  # building and sending the step's message
    num_seqs: int
    num_tokens: int  # computed this step (prompt chunks, decodes, drafts)
    num_output_tokens: int
    k: int  # draft tokens asked per request (0: plain decoding)
    num_prefill_tokens: int = 0  # of num_tokens, prompt chunks' (0: a step of decodes only)


class StepTimeline:
    def __init__(self, capacity: int = 4096) -> None:
        self.entries: deque[TimelineEntry] = deque(maxlen=capacity)

    def record(self, entry: TimelineEntry) -> None:
        self.entries.append(entry)

    def summary(self, last_seconds: float | None = None, now: float | None = None) -> dict:
        """Figures over the entries of the last ``last_seconds`` (all kept ones by default)."""
        entries = list(self.entries)
        if last_seconds is not None and entries:
            end = now if now is not None else entries[-1].started + _length(entries[-1])
            entries = [e for e in entries if e.started >= end - last_seconds]
        steps = [e for e in entries if e.step_seconds > 0]
        if not steps:
            return {"num_steps": 0}
        wall = entries[-1].started + _length(entries[-1]) - entries[0].started
        stepping = sum(e.step_seconds for e in steps)
        n = len(steps)
        return {
            "num_steps": n,
            "wall_seconds": wall,
            "busy_fraction": stepping / wall if wall > 0 else 1.0,
            "idle_fraction": sum(e.idle_seconds for e in entries) / wall if wall > 0 else 0.0,
            "mean_batch_size": sum(e.num_seqs for e in steps) / n,
            "mean_tokens_per_step": sum(e.num_tokens for e in steps) / n,
            "mean_output_tokens_per_step": sum(e.num_output_tokens for e in steps) / n,
            "mean_step_ms": 1000 * stepping / n,
            "mean_forward_and_sampling_ms": 1000 * sum(e.execute_seconds for e in steps) / n,
            "mean_python_around_forward_ms": 1000 * sum(e.step_seconds - e.execute_seconds for e in steps) / n,
            "mean_handoff_ms": 1000 * sum(e.receive_seconds + e.send_seconds for e in steps) / n,
            "output_tokens_per_second": sum(e.num_output_tokens for e in steps) / wall if wall > 0 else 0.0,
            **_split(steps),
        }

    def recent(self, count: int = 50) -> list[dict]:
        return [asdict(e) for e in list(self.entries)[-count:]]


def _split(steps: list[TimelineEntry]) -> dict:
    """The steps that carried a prompt's chunk against those of decodes only, and the share that
    verified drafts: where a step's time went when the mean alone does not say."""
    prefill = [e for e in steps if e.num_prefill_tokens > 0]
    decode = [e for e in steps if e.num_prefill_tokens == 0]
    return {
        "prefill_step_fraction": len(prefill) / len(steps),
        "mean_prefill_step_ms": 1000 * sum(e.step_seconds for e in prefill) / len(prefill) if prefill else None,
        "mean_prefill_tokens_per_prefill_step": (sum(e.num_prefill_tokens for e in prefill) / len(prefill)
                                                 if prefill else None),
        "mean_decode_step_ms": 1000 * sum(e.step_seconds for e in decode) / len(decode) if decode else None,
        "mean_decode_batch_size": sum(e.num_seqs for e in decode) / len(decode) if decode else None,
        "drafting_step_fraction": sum(1 for e in steps if e.k > 0) / len(steps),
    }


def _length(entry: TimelineEntry) -> float:
    return entry.idle_seconds + entry.receive_seconds + entry.step_seconds + entry.send_seconds
