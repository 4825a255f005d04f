"""The engine core's recent steps on a clock, for seeing where serving time goes.

Each loop of the core (``engine_core.py``) records one ``TimelineEntry``: when it began,
how long it waited for work (idle), took messages from the replica, stepped (and of that,
the runner's forward pass and sampling), and sent the step's message. ``summary`` turns a
window of entries into the figures the served-path benchmark reports: the share of wall
time the engine was stepping, the mean batch and tokens per step, and the time per step
spent in Python around the forward pass. ``GET /debug/timeline`` shows it for a replica.
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
    k: int


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
        }

    def recent(self, count: int = 50) -> list[dict]:
        return [asdict(e) for e in list(self.entries)[-count:]]


def _length(entry: TimelineEntry) -> float:
    return entry.idle_seconds + entry.receive_seconds + entry.step_seconds + entry.send_seconds
