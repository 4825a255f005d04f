"""Proposers: where draft tokens come from.

A proposer gets the step's decoding requests, each with the number of draft tokens
the scheduler reserved room for, and returns up to that many tokens per request
(fewer is fine). ``probs`` holds, per request, the distributions the drafts were
sampled from (``[num_drafts, vocab_size]``), or is None when drafts are
deterministic (n-gram lookup): the rejection sampler then treats them as one-hot.
A proposer whose ``free_lookahead`` is True drafts one-hot tokens without a model pass, so
drafting past the verified ``k`` costs next to nothing (``cluster.spec_decode.lookahead``).
"""

from __future__ import annotations

from typing import Protocol


from cluster.shared.draft_proposal import DraftProposal
from cluster.shared.scheduled import ScheduledRequest
from cluster.spec_decode.ngram import NgramProposer


class Proposer(Protocol):
    def propose(
        self, scheduled: list[ScheduledRequest], block_tables: list[list[int]]
    ) -> DraftProposal: ...

    def record(self, aux_hidden: dict) -> None:
        """The target's aux states of a step (``StepResult.aux_hidden``; empty unless a head asked)."""

    def free(self, request_id: str) -> None:
        """The request is finished or aborted."""


class NgramStepProposer:
    """Prompt lookup over each request's own tokens; no model, no KV cache."""

    free_lookahead = True

    def __init__(self, min_n: int, max_n: int, draft_per_match_token: float | None = None) -> None:
        self.ngram = NgramProposer(min_n, max_n, draft_per_match_token)

    def record(self, aux_hidden: dict) -> None:
        pass

    def free(self, request_id: str) -> None:
        pass

    def propose(
        self, scheduled: list[ScheduledRequest], block_tables: list[list[int]]
    ) -> DraftProposal:
        active = [s for s in scheduled if s.num_draft_tokens > 0]
        drafts = self.ngram.propose([s.request.all_token_ids for s in active],
                                    [s.num_draft_tokens for s in active])
        return DraftProposal({s.request.request_id: d for s, d in zip(active, drafts) if d}, None)
