"""One step's plan as the scheduler hands it to the runner and the proposers (no torch: the
scheduler decides, the runner computes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.shared.request import Request


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_computed_tokens: int  # before this step
    num_new_tokens: int  # tokens whose K/V this step computes
    num_draft_tokens: int = 0  # draft tokens the target verifies after them (lookahead slots reserved)

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the request's tokens, so it samples."""
        return self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
