"""Drafts past the verified ``k``, checked against what each request goes on to say.

A controller holding a small ``k`` only sees acceptance at the positions it verifies, so a
deep position that would pay (a replica answering prompts it has answered before) is never
learnt unless it pays for verifying it. Where drafting costs no model pass and the drafts are
one-hot (n-gram lookup, suffix trees), the proposer can be asked for ``depth`` tokens every
step, the first ``k`` verified as before and the whole draft kept here. Once the request's
own tokens reach past it (or differ from it), the draft is scored: how many of its leading
tokens the request really produced.

That count has the distribution of the number accepted had all ``depth`` tokens been verified
in that step, at any temperature: rejection sampling accepts a one-hot draft token with the
target's probability of that token, which is the probability that the target's own sample at
that position is that token, and a rejected position is resampled from a residual that never
gives the draft token (so at the positions verified, "the request produced it" and "accepted"
are the same event). The records have the controller's meaning: (positions asked for, tokens
proposed, tokens accepted).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Callable

from cluster.shared.draft_proposal import DraftProposal
from cluster.shared.request import Request
from cluster.shared.scheduled import ScheduledRequest


class LookaheadDrafts:
    """Wraps a proposer (one-hot drafts, no model pass) to draft ``depth`` tokens for every decoding
    request a step and keep them until the request's tokens score them."""

    def __init__(self, proposer, depth: int, max_records: int = 4096) -> None:
        if depth < 1:
            raise ValueError(f"a lookahead depth must be >= 1, got {depth}")
        self.proposer = proposer
        self.depth = depth
        # request id -> drafts not yet scored: (index of the first draft token, asked, tokens)
        self._pending: dict[str, list[tuple[int, int, list[int]]]] = {}
        # scored drafts not yet handed out (steps with prompt chunks are not observed: they wait)
        self._records: deque[tuple[int, int, int]] = deque(maxlen=max_records)

    def propose(self, scheduled: list[ScheduledRequest], block_tables: list[list[int]],
                room: Callable[[Request, int], int]) -> DraftProposal | None:
        """The step's drafts (each request's first ``num_draft_tokens``, None when no request drafts),
        having asked the proposer for up to ``room(request, depth)`` tokens for each request decoding."""
        asked: dict[str, int] = {}
        widened = []
        for s in scheduled:
            if s.num_new_tokens == 1 and s.samples:
                n = room(s.request, self.depth)
                if n > 0:
                    asked[s.request.request_id] = n
                    s = dataclasses.replace(s, num_draft_tokens=max(n, s.num_draft_tokens))
            widened.append(s)
        verified = {s.request.request_id: s.num_draft_tokens for s in scheduled if s.num_draft_tokens > 0}
        if not asked and not verified:
            return None
        proposal = self.proposer.propose(widened, block_tables)
        for s in scheduled:
            rid = s.request.request_id
            if rid in asked:
                tokens = list(proposal.token_ids.get(rid, ()))
                self._pending.setdefault(rid, []).append((s.request.num_tokens, asked[rid], tokens))
        if not verified:
            return None
        drafts = {rid: tokens[: verified[rid]] for rid, tokens in proposal.token_ids.items()
                  if rid in verified and tokens}
        return DraftProposal(drafts, None)  # one-hot: the proposers wrapped have no distributions

    def score(self, requests: list[Request]) -> None:
        """Score the drafts of ``requests`` whose tokens now reach past them or differ from them."""
        for request in requests:
            pending = self._pending.get(request.request_id)
            if not pending:
                continue
            tokens = request.all_token_ids
            kept = []
            for start, asked, draft in pending:
                known = len(tokens) - start
                matched = 0
                while matched < min(known, len(draft)) and tokens[start + matched] == draft[matched]:
                    matched += 1
                if matched < len(draft) and matched >= known:  # the next draft token is not yet checked
                    kept.append((start, asked, draft))
                else:
                    self._records.append((asked, len(draft), matched))
            self._pending[request.request_id] = kept

    def take(self) -> list[tuple[int, int, int]]:
        """The drafts scored since the last call: (positions asked for, tokens proposed, tokens accepted)."""
        records = list(self._records)
        self._records.clear()
        return records

    def free(self, request_id: str) -> None:
        """The request ended: drafts it never reached are dropped unscored."""
        self._pending.pop(request_id, None)
