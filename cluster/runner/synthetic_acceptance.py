"""Acceptance set by hand, for timing only (SGLang's ``SGLANG_SIMULATE_ACC_LEN`` does the like).

The rig that gives the engine the paper's proportions (random-weight targets and drafts of
chosen shapes) cannot have their real acceptance: random drafts agree with nothing. With a
:class:`SyntheticAcceptance` on the runner every pass still runs at its real shape and cost;
only the accept decision is drawn. A request with ``k`` drafts accepts its first ``L``, ``L``
the number of leading successes of independent draws, position ``j`` succeeding with
probability ``alphas[j]`` (the last value repeats past the list); the token after them is the
target's argmax there. Outputs are then not the target's, so the switch is set on the runner by
``tandem bench`` and ``tandem profile`` only, never by a serving config, and every table and
JSON made with it carries :meth:`SyntheticAcceptance.label`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from cluster.runner.rejection import RejectionOutput


@dataclass
class SyntheticAcceptance:
    alphas: tuple[float, ...]  # P(position j accepted | the ones before it were)
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.alphas = tuple(float(a) for a in self.alphas)
        if not self.alphas or not all(0.0 <= a <= 1.0 for a in self.alphas):
            raise ValueError(f"synthetic acceptance: one or more probabilities in [0, 1], got {self.alphas}")
        self._rng = random.Random(self.seed)

    @classmethod
    def parse(cls, text: str, seed: int = 0) -> "SyntheticAcceptance":
        """``"0.7"`` (every position) or ``"0.9,0.8,0.7"`` (per position, the last repeating)."""
        try:
            return cls(tuple(float(part) for part in text.split(",") if part.strip()), seed)
        except ValueError as err:
            raise ValueError(f"synthetic acceptance must be a probability or a comma-separated list of them "
                             f"(e.g. 0.7 or 0.9,0.8,0.7), got {text!r}: {err}") from None

    def label(self) -> str:
        return "synthetic acceptance α = " + ", ".join(f"{a:g}" for a in self.alphas)

    def alpha(self, position: int) -> float:
        return self.alphas[min(position, len(self.alphas) - 1)]

    def length_distribution(self, k: int) -> list[float]:
        """P(L = l) for l = 0..k, with ``k`` drafts."""
        probs, reach = [], 1.0  # reach: P(the first l positions all accepted)
        for position in range(k):
            probs.append(reach * (1.0 - self.alpha(position)))
            reach *= self.alpha(position)
        return probs + [reach]

    def draw(self, k: int) -> int:
        accepted = 0
        while accepted < k and self._rng.random() < self.alpha(accepted):
            accepted += 1
        return accepted

    def verify(self, draft_token_ids: list[list[int]], target_argmax: list[int]) -> RejectionOutput:
        """``greedy_verify``'s shapes with the accept decision drawn: per request its first ``L``
        drafts, then the target's argmax at position ``L``."""
        outputs, num_accepted, offset = [], [], 0
        for drafts in draft_token_ids:
            accepted = self.draw(len(drafts))
            outputs.append(list(drafts[:accepted]) + [target_argmax[offset + accepted]])
            num_accepted.append(accepted)
            offset += len(drafts) + 1
        return RejectionOutput(output_token_ids=outputs, num_accepted=num_accepted)
