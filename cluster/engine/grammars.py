"""The engine's side of structured outputs: each constrained request's grammar, kept in step
with its output tokens, and the token bitmasks of one step.

Per step (``prepare``), for every constrained request that samples: its drafts are cut at the
first token the grammar forbids, and one bitmask row is written per verified position (the
grammar's state after the accepted drafts before it). The runner applies the rows to the
target's logits before penalties, temperature and top-k/p, so the verifier samples from the
masked target distribution. Exactness under speculation:

- a draft from a point-mass proposer (n-gram lookup, no draft probabilities) that the grammar
  forbids would be rejected with certainty and the position resampled from the masked target
  alone, so cutting it changes nothing but the work;
- a draft model's forbidden token is kept (its successors are cut): rejection sampling rejects
  it with certainty and resamples from the residual of the masked target against the draft's
  distribution, which is what keeps the output exact; sampling the masked target there instead
  would not be.

After the step (``advance``) each grammar consumes the request's new output tokens. A grammar
that completes ends the request (``stop``) at the token that completed it; one that reaches a
dead end (an llguidance error) ends it with ``grammar_dead_end`` (also its ``stop_reason``, which
the API keeps under the finish reason ``stop``) and drops the token sampled from it. Preemption needs nothing: the state follows output tokens, which recompute keeps.
"""

from __future__ import annotations

import time

import torch

from cluster.shared.request import Request, RequestStatus
from cluster.engine.scheduler import Scheduler
from cluster.shared.draft_proposal import DraftProposal
from cluster.shared.scheduled import ScheduledRequest
from cluster.structured.matcher import GrammarMatcher, bitmask_words
from cluster.structured.vocabulary import grammar_tokenizer

DEAD_END = RequestStatus.FINISHED_DEAD_END.value  # the stop_reason of a request its grammar ended


class Grammars:
    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None) -> None:
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_id = eos_token_id
        self._tokenizer = None  # llguidance's vocabulary, built at the first constrained request
        self.seconds = 0.0  # spent in prepare and advance (masks, draft checks, consuming tokens)

    def matcher_for(self, params) -> GrammarMatcher | None:
        """A new grammar state for a request with these sampling params (None: unconstrained).
        Raises ValueError (a ``ConstraintError`` naming the request field) for a grammar that this
        vocabulary cannot serve."""
        constraint = params.structured_outputs
        if constraint is None:
            return None
        if self._hf_tokenizer is None:
            raise ValueError("structured outputs need a tokenizer; this model has none")
        if self._tokenizer is None:
            self._tokenizer = grammar_tokenizer(self._hf_tokenizer, self._vocab_size, self._eos_token_id)
        return GrammarMatcher(self._tokenizer, constraint)

    def prepare(self, scheduled: list[ScheduledRequest], drafts: DraftProposal | None
                ) -> tuple[DraftProposal | None, dict[str, torch.Tensor] | None]:
        """The step's drafts with forbidden tokens cut, and ``{request id: [positions, words]
        int32 bitmask}`` for the constrained requests that sample (rows: the draft positions, then
        the bonus position); ``(drafts, None)`` when no request in the step is constrained."""
        constrained = [s for s in scheduled if s.request.grammar is not None and s.samples]
        if not constrained:
            return drafts, None
        started = time.perf_counter()
        masks: dict[str, torch.Tensor] = {}
        if drafts is not None:
            drafts = drafts._replace(token_ids=dict(drafts.token_ids),
                                     probs=None if drafts.probs is None else dict(drafts.probs))
        for sched in constrained:
            rid, matcher = sched.request.request_id, sched.request.grammar
            proposed = drafts.token_ids.get(rid, []) if drafts is not None else []
            valid = matcher.num_valid(proposed)
            keep = valid if drafts is None or drafts.probs is None else min(valid + 1, len(proposed))
            if keep < len(proposed):
                drafts.token_ids[rid] = proposed[:keep]
                if drafts.probs is not None and rid in drafts.probs:
                    drafts.probs[rid] = drafts.probs[rid][:keep]
            bitmask = torch.full((keep + 1, bitmask_words(self._vocab_size)), -1, dtype=torch.int32)
            if not matcher.is_dead:  # a dead grammar samples anything: advance drops the token and ends it
                matcher.fill_masks(bitmask, 0, proposed[:valid])
            masks[rid] = bitmask
        self.seconds += time.perf_counter() - started
        return drafts, masks

    def advance(self, requests: list[Request], scheduler: Scheduler) -> None:
        """Feed each constrained request its new output tokens; end those whose grammar is done."""
        started = time.perf_counter()
        for request in requests:
            matcher = request.grammar
            if matcher is None:
                continue
            end = matcher.advance(request.output_token_ids)
            if end is not None:
                request.truncate_output(end)
                if matcher.is_dead:
                    request.stop_reason = DEAD_END
                self._finish(request, RequestStatus.FINISHED_DEAD_END if matcher.is_dead
                             else RequestStatus.FINISHED_STOPPED, scheduler)
        self.seconds += time.perf_counter() - started

    def _finish(self, request: Request, status: RequestStatus, scheduler: Scheduler) -> None:
        if request.is_finished:
            request.status = status
        else:
            scheduler.finish_request(request.request_id, status)
