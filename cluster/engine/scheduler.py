"""Continuous batching: which requests run this step, and how many tokens each.

Policy, per step, under a token budget (``max_num_batched_tokens``) and a cap on
running requests (``max_num_seqs``):

1. Running requests first, in arrival order: one token for a decoding request, the
   next chunk for one still in prefill. When blocks run out, the newest running
   request is preempted (blocks freed, recomputed later) until the older one fits;
   under ``policy: priority``, the running request of the lowest priority (the largest
   ``priority`` value, the newest among equals), as in vLLM.
2. Then waiting requests, first come first served (``policy: priority``: by priority, lower
   first, then arrival; a preempted request queues by the same order), each with as much of its prompt
   as the remaining budget allows (chunked prefill). In a step that also decodes, prompts (running
   or newly admitted) get at most ``max_prompt_tokens_beside_decodes`` tokens together (when set):
   a decode then waits for at most that much prompt. While requests are running,
   waiting ones are admitted only when there are at least
   ``floor(num_running * waiting_served_ratio)`` of them, or the oldest has waited
   ``max_waiting_steps`` steps (TGI's ``waiting_served_ratio``). A step that had to
   preempt admits nothing. A new or preempted request first takes the longest cached
   prefix of its tokens from the prefix cache and is scheduled only for the rest (not one
   that asks for its prompt's logprobs: its whole prompt runs, as in vLLM). Where the
   block after that prefix is one a running request is computing, it stays waiting (those
   behind it may go first) and takes the block from the cache once computed, rather than
   computing the same prefix twice.

The scheduler decides; it never touches tensors.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable

from cluster.config import SchedulerConfig
from cluster.shared.request import Request, RequestStatus
from cluster.shared.sampled import SampledTokens
from cluster.shared.scheduled import ScheduledRequest, SchedulerOutput
from cluster.kv.block_manager import NO_PREFIX, BlockManager
from cluster.spec_decode.drafting import may_draft


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        max_waiting_steps: int = 20,
        may_draft: Callable[[Request], bool] = may_draft,
    ) -> None:
        """``may_draft``: which decoding requests may verify drafts (the speculation policy's rule)."""
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.may_draft = may_draft
        self.max_waiting_steps = max_waiting_steps
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_computed_tokens_total = 0  # tokens that went through the model
        self._prompt_budget: int | None = None  # prompt tokens this step may still take (None: no cap)

    # ---- queue management -------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self._enqueue(request, front=False)

    def _enqueue(self, request: Request, front: bool) -> None:
        """Into the waiting queue: at its end (new) or its front (preempted) first come, first served;
        by (priority, arrival) under the priority policy."""
        if self.config.policy != "priority":
            self.waiting.appendleft(request) if front else self.waiting.append(request)
            return
        key = _priority_key(request)
        position = next((i for i, r in enumerate(self.waiting) if _priority_key(r) > key), len(self.waiting))
        self.waiting.insert(position, request)

    def _victim(self) -> Request:
        """The running request to preempt when blocks run out."""
        if self.config.policy == "priority":
            return max(self.running, key=_priority_key)
        return self.running[-1]

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (or abort) a request now and free its blocks. Unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        request.status = status
        self.block_manager.free(request_id)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step ---------------------------------------------------------------
    def schedule(self, num_lookahead_tokens: int = 0) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        cap = self.config.max_prompt_tokens_beside_decodes
        self._prompt_budget = cap if cap and any(self._decodes(r) for r in self.running) else None

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:
                i += 1
                continue
            num_drafts = 0
            if num_lookahead_tokens and self._is_decoding(request, num_new):
                num_drafts = min(self.num_draft_tokens(request, num_lookahead_tokens), budget - num_new)
            while not self.block_manager.allocate_slots(
                request.request_id, request.num_computed_tokens, num_new, num_drafts
            ):
                victim = self._victim()
                position = self.running.index(victim)
                budget += self._preempt(victim, out)
                if victim is request:
                    break
                if position < i:  # one scheduled before it this step (priority policy): the list moved up
                    i -= 1
            if request.status is not RequestStatus.RUNNING:
                break  # it preempted itself: nothing after it is left either
            out.scheduled.append(ScheduledRequest(request, request.num_computed_tokens, num_new, num_drafts))
            budget -= num_new + num_drafts
            i += 1

        # No admissions in a step that had to preempt: memory is short already.
        if self.waiting and not out.preempted and self._should_admit():
            self._admit_waiting(out, budget)
        for request in self.waiting:
            request.waiting_steps += 1
        return out

    def _should_admit(self) -> bool:
        if not self.running:
            return True
        if self.waiting[0].waiting_steps >= self.max_waiting_steps:
            return True
        return len(self.waiting) >= math.floor(len(self.running) * self.config.waiting_served_ratio)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        sharing: list[Request] = []  # waiting for blocks another request is computing
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            cached = NO_PREFIX
            # New or preempted: reuse cached blocks, unless the prompt's logprobs are asked for
            # (they need the logits at every prompt position, so the whole prompt runs).
            reuse = request.num_computed_tokens == 0 and request.sampling_params.prompt_logprobs is None
            if reuse:
                cached = self.block_manager.find_cached_prefix(request)
                if self.block_manager.computed_elsewhere(request, cached):
                    sharing.append(self.waiting.popleft())
                    continue
            num_new = self._num_new_tokens(request, budget, cached.num_tokens)
            if num_new == 0:
                break
            if not self.block_manager.allocate_slots(
                request.request_id, cached.num_tokens, num_new, cached=cached
            ):
                break  # FCFS: no overtaking the head of the queue
            if reuse:
                self.block_manager.record_lookup(request.num_tokens, cached.num_tokens)
                self.block_manager.claim_in_flight(request, len(cached.block_ids))
            if cached.num_tokens:
                request.num_computed_tokens = cached.num_tokens
                if request.num_preemptions == 0:
                    request.num_cached_tokens = cached.num_tokens
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.waiting_steps = 0
            if request.scheduled_time is None:
                request.scheduled_time = time.monotonic()
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, request.num_computed_tokens, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(sharing))  # their places in the queue kept

    def _num_new_tokens(self, request: Request, budget: int, num_computed: int | None = None) -> int:
        if num_computed is None:
            num_computed = request.num_computed_tokens
        remaining = request.num_tokens - num_computed
        prompt = self.config.enable_chunked_prefill and self._prompt_budget is not None and remaining > 1
        if prompt:  # a prompt beside decodes: what is left of the step's prompt tokens
            budget = min(budget, self._prompt_budget)
        num_new = remaining if remaining <= budget else budget if self.config.enable_chunked_prefill else 0
        if prompt:
            self._prompt_budget -= num_new
        return num_new

    @staticmethod
    def _decodes(request: Request) -> bool:
        """Whether a running request's next step is a decode (one new token, drafts aside)."""
        return request.num_output_tokens > 0 and request.num_tokens - request.num_computed_tokens == 1

    def num_draft_tokens(self, request: Request, k: int) -> int:
        """How many of ``k`` draft tokens this request can verify in its next step: none where
        ``may_draft`` says so, and never so many that the output passes ``max_tokens`` or the
        context ``max_model_len``."""
        if not self.may_draft(request):
            return 0
        params = request.sampling_params
        room = min(params.max_tokens - request.num_output_tokens - 1, self.max_model_len - request.num_tokens)
        return max(0, min(k, room))

    @staticmethod
    def _is_decoding(request: Request, num_new: int) -> bool:
        return request.num_output_tokens > 0 and request.num_computed_tokens + num_new == request.num_tokens

    def _preempt(self, request: Request, out: SchedulerOutput) -> int:
        """Free ``request``'s blocks and queue it again; returns the tokens it had been given this step."""
        self.running.remove(request)
        self.block_manager.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.draft_num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request, front=True)
        out.preempted.append(request)
        given = sum(s.num_new_tokens + s.num_draft_tokens for s in out.scheduled if s.request is request)
        out.scheduled[:] = [s for s in out.scheduled if s.request is not request]
        return given

    # ---- after the model ran ----------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, SampledTokens]) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish what should stop.

        ``sampled`` holds, per request that sampled, its accepted draft tokens and then one
        sampled token, and how many drafts were accepted; the K/V of the accepted drafts is
        verified, so they count as computed. Returns the requests that finished in this step
        (their blocks are already free).
        """
        finished: list[Request] = []
        now = time.monotonic()
        for sched in out.scheduled:
            request = sched.request
            if request.is_finished:  # aborted while the step ran
                continue
            step = sampled.get(request.request_id)
            tokens = step.token_ids if step is not None else None
            num_accepted = step.num_accepted if step is not None else 0
            request.num_computed_tokens = sched.num_computed_tokens + sched.num_new_tokens + num_accepted
            request.draft_num_computed_tokens = min(request.draft_num_computed_tokens, request.num_computed_tokens)
            self.num_computed_tokens_total += sched.num_new_tokens + sched.num_draft_tokens
            self.block_manager.cache_full_blocks(request)
            if not tokens:
                continue
            if request.first_token_time is None:
                request.first_token_time = now
            for token in tokens:
                request.append_output_token_ids([token])
                status = self._stop_status(request, token)
                if status is not None:
                    finished.append(self.finish_request(request.request_id, status))
                    break
        return finished

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens and request.is_stop_token(token):
            if token != request.eos_token_id or params.ignore_eos:
                request.stop_reason = token  # a stop id names itself; EOS stops with no reason
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def check_invariants(self) -> None:
        self.block_manager.check_invariants()
        ids = {r.request_id for r in self.running} | {r.request_id for r in self.waiting}
        if ids != set(self.requests):
            raise AssertionError("the running and waiting queues disagree with the request table")
        for r in self.waiting:
            if r.request_id in self.block_manager.block_tables and r.num_computed_tokens == 0:
                if self.block_manager.block_tables[r.request_id]:
                    raise AssertionError(f"waiting {r} holds blocks")


def _priority_key(request: Request) -> tuple[int, float]:
    return request.sampling_params.priority, request.arrival_time
