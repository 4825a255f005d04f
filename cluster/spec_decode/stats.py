"""Counters of speculative decoding, under the meanings vLLM exports them with."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # requests-steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: accepted drafts at position j
    reached_per_position: list[int] = field(default_factory=list)  # [j]: drafts at j whose predecessors were accepted
    # Counted over the positions the scheduler asked for, proposed or not (n-gram lookup may
    # propose fewer tokens than asked, or none): what the latency model needs.
    asked_per_position: list[int] = field(default_factory=list)  # [j]: requests asked for position j
    proposed_per_position: list[int] = field(default_factory=list)  # [j]: ... that got a draft token there
    asked_reached_per_position: list[int] = field(default_factory=list)  # [j]: ... whose predecessors were accepted
    k_per_step: Counter = field(default_factory=Counter)  # k chosen -> number of steps
    recent_k: deque = field(default_factory=lambda: deque(maxlen=1024))  # k of the latest steps

    def record_step(self, k: int) -> None:
        self.k_per_step[k] += 1
        self.recent_k.append(k)

    def record_request(self, num_draft_tokens: int, num_accepted: int, num_asked: int | None = None) -> None:
        """One request's verification: ``num_asked`` draft positions reserved for it (default:
        as many as were proposed), ``num_draft_tokens`` proposed, the first ``num_accepted``
        of them accepted."""
        num_asked = num_draft_tokens if num_asked is None else num_asked
        if num_asked < num_draft_tokens or not 0 <= num_accepted <= num_draft_tokens:
            raise ValueError(f"inconsistent draft counts: asked {num_asked}, proposed {num_draft_tokens}, "
                             f"accepted {num_accepted}")
        for counts in (self.asked_per_position, self.proposed_per_position, self.asked_reached_per_position):
            if len(counts) < num_asked:
                counts.extend([0] * (num_asked - len(counts)))
        for j in range(num_asked):
            self.asked_per_position[j] += 1
        for j in range(num_draft_tokens):
            self.proposed_per_position[j] += 1
        for j in range(min(num_accepted + 1, num_asked)):
            self.asked_reached_per_position[j] += 1
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for counts in (self.accepted_per_position, self.reached_per_position):
            if len(counts) < num_draft_tokens:
                counts.extend([0] * (num_draft_tokens - len(counts)))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1
        for j in range(min(num_accepted + 1, num_draft_tokens)):
            self.reached_per_position[j] += 1

    @property
    def current_k(self) -> int:
        """The k of the latest step (0 before any step or without speculation)."""
        return self.recent_k[-1] if self.recent_k else 0

    @property
    def conditional_acceptance(self) -> list[float]:
        """Per position j: P(draft j accepted | drafts before it accepted)."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted_per_position, self.reached_per_position)]

    @property
    def effective_acceptance(self) -> list[float]:
        """Per position j asked for: P(a token accepted at j | the positions before it accepted),
        a position asked for but not proposed counting as rejected. With it, E(k) of
        :mod:`cluster.spec_decode.latency_model` is the tokens a request really gains per step."""
        accepted = self.accepted_per_position
        return [(accepted[j] if j < len(accepted) else 0) / reached if reached else 0.0
                for j, reached in enumerate(self.asked_reached_per_position)]

    @property
    def coverage(self) -> list[float]:
        """Per position j: the share of requests asked for a draft token at j that got one."""
        return [p / a if a else 0.0 for p, a in zip(self.proposed_per_position, self.asked_per_position)]

    @property
    def acceptance_rate(self) -> float:
        """vLLM's: accepted / proposed draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def effective_acceptance_rate(self) -> float:
        """Accepted / draft positions asked for (a position lookup left empty counts as
        rejected): a request asked for k drafts per step gains 1 + k * this rate tokens per
        step, which ``acceptance_rate`` over-states whenever proposals fall short of k."""
        asked = sum(self.asked_per_position)
        return self.num_accepted_tokens / asked if asked else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verifying step of a request: accepted drafts + 1."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
