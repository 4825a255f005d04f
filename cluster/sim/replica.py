"""One simulated replica: continuous batching with speculation, one step at a time.

State lives in numpy arrays over ``max_num_seqs`` slots (no per-token objects). A step
is planned when it starts (:meth:`SimReplica.start_step`: admit waiting requests FCFS
while a slot and the KV capacity allow, let the controller pick ``k``, give the
token budget to the decoding requests first and the rest to prefill chunks in
admission order, as ``cluster/engine/scheduler.py`` does) and applied when it ends
(:meth:`SimReplica.finish_step`: draw accepted drafts per request from the per-position
acceptance, append tokens, finish requests, preempt the newest requests if the KV
cache overflowed, feed the controller and the step-time tracker what the engine
would).

Invariants (:meth:`check_invariants`): occupied slots == ``num_running`` <= max_num_seqs;
``kv_used`` == the occupied slots' context plus prompt tokens still to prefill (a prompt's
blocks are reserved when it is admitted) <= KV capacity after preemption; every
running request has tokens left to produce; ``decoding`` marks exactly the occupied
slots whose prompt is computed, and ``prefilling`` lists the others in admission order
(kept as the step changes them, so planning a step needs no search over the slots).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

from cluster.routing.stats import ReplicaStats
from cluster.routing.step_times import StepTimeTracker
from cluster.sim.controllers import SimAdaptiveController
from cluster.sim.device_model import StepModel
from cluster.sim.requests import RequestTable
from cluster.spec_decode.controller import BatchState, SpeculationController, StepObservation

_NO_REQUESTS = np.zeros(0, dtype=np.int64)
PREFIX_CACHE_ENTRIES = 64  # shared prefixes a replica keeps cached (least recently used go first)


@dataclass(frozen=True)
class ReplicaSettings:
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    prefix_affinity_blocks: int
    stats_period_s: float
    step_time_scale: float = 1.0
    step_noise: float = 0.0


@dataclass
class StepPlan:
    started: float
    seconds: float
    k: int
    decode_slots: np.ndarray  # [num_decode] slot indices
    prefill_slots: list[int]
    prefill_chunks: list[int]


class SimReplica:
    def __init__(self, replica_id: str, group: str, device_kind: str, model: StepModel,
                 controller: SpeculationController, tracker: StepTimeTracker, settings: ReplicaSettings,
                 requests: RequestTable, rng: np.random.Generator) -> None:
        self.replica_id, self.group, self.device_kind = replica_id, group, device_kind
        self.model, self.controller, self.tracker, self.settings = model, controller, tracker, settings
        self.requests, self.rng = requests, rng
        size = settings.max_num_seqs
        self.req = np.full(size, -1, dtype=np.int64)
        self.prefill_left = np.zeros(size, dtype=np.int64)
        self.out_left = np.zeros(size, dtype=np.int64)
        self.context = np.zeros(size, dtype=np.int64)
        self.admit_seq = np.zeros(size, dtype=np.int64)
        self.free_slots = list(range(size - 1, -1, -1))
        self.waiting: deque[int] = deque()
        self.num_running = 0
        self.kv_used = 0
        self.num_admitted = 0
        self.decoding = np.zeros(size, dtype=bool)  # occupied and the prompt computed
        self.prefilling: list[int] = []  # occupied slots with prompt tokens to compute, admission order
        self.prefix_cache: OrderedDict[int, int] = OrderedDict()  # prefix id -> cached tokens
        acceptance = list(model.acceptance) or [0.0]
        self.acceptance = np.array([acceptance[min(j, len(acceptance) - 1)] for j in range(max(model.max_k, 16) + 1)])
        self.plan: StepPlan | None = None
        self.num_drafted = self.num_accepted = self.num_steps = self.num_preemptions = 0
        self.busy_seconds = 0.0
        self.num_output_tokens = 0  # tokens appended to outputs (preempted requests keep theirs)
        self.k_steps = np.zeros(17, dtype=np.int64)  # steps per k
        self.last_k = 0
        self._stats: ReplicaStats | None = None

    # ---- load ---------------------------------------------------------------------
    @property
    def load(self) -> int:
        return self.num_running + len(self.waiting)

    @property
    def num_prefilling(self) -> int:
        """Running requests with prompt tokens still to compute."""
        return len(self.prefilling)

    @property
    def busy(self) -> bool:
        return self.plan is not None

    def enqueue(self, request: int) -> None:
        self.waiting.append(request)

    # ---- a step -------------------------------------------------------------------
    def start_step(self, now: float) -> float | None:
        """Plan the next step at ``now``; its end time, or None when there is nothing to do."""
        self._admit(now)
        if self.num_running == 0:
            self.plan = None
            return None
        decode_slots = self.decoding.nonzero()[0]
        num_decode = len(decode_slots)
        k = self.controller.choose_k(BatchState(self.num_running, len(self.waiting)))
        budget = self.settings.max_num_batched_tokens - num_decode * (1 + k)
        prefill_slots, chunks = [], []
        if budget > 0 and self.prefilling:
            for slot in self.prefilling:
                chunk = min(int(self.prefill_left[slot]), budget)
                prefill_slots.append(slot)
                chunks.append(chunk)
                budget -= chunk
                if budget <= 0:
                    break
        seconds = self.model.step_seconds(num_decode, k, sum(chunks), len(chunks)) * self.settings.step_time_scale
        if self.settings.step_noise:
            seconds *= float(self.rng.lognormal(0.0, self.settings.step_noise))
        self.plan = StepPlan(now, seconds, k if num_decode else 0, decode_slots, prefill_slots, chunks)
        return now + seconds

    def finish_step(self, now: float) -> np.ndarray:
        """Apply the planned step ending at ``now``; the requests it finished."""
        plan, self.plan = self.plan, None
        k, dec = plan.k, plan.decode_slots
        self.num_steps += 1
        self.busy_seconds += plan.seconds
        self.k_steps[k] += 1
        self.last_k = k
        num_decode = len(dec)
        accepted = None  # [num_decode, k]: 1 on each request's accepted prefix of drafts
        done = []
        if num_decode:
            out_left = self.out_left[dec]
            if k:
                hits = self.rng.random((num_decode, k)) < self.acceptance[:k]
                accepted = np.logical_and.accumulate(hits, axis=1)
                gained = np.add.reduce(accepted, axis=1)
                self.num_drafted += num_decode * k
                self.num_accepted += int(np.add.reduce(gained))
                gained += 1
            else:
                gained = np.ones(num_decode, dtype=np.int64)
            np.minimum(gained, out_left, out=gained)
            num_gained = int(np.add.reduce(gained))
            self.num_output_tokens += num_gained
            self.kv_used += num_gained
            out_left -= gained
            self.out_left[dec] = out_left
            self.context[dec] += gained
            done = dec[out_left <= 0].tolist()
        for slot, chunk in zip(plan.prefill_slots, plan.prefill_chunks):
            left = int(self.prefill_left[slot]) - chunk
            self.prefill_left[slot] = left
            self.context[slot] += chunk
            if left == 0:  # the last chunk samples the first token
                self.prefilling.remove(slot)
                self.decoding[slot] = True
                self.out_left[slot] -= 1
                self.context[slot] += 1
                self.num_output_tokens += 1
                self.kv_used += 1
                self.requests.first_token(int(self.req[slot]), now)
                if self.out_left[slot] <= 0:
                    done.append(slot)
        finished = self.req[done].copy() if done else _NO_REQUESTS
        if done:
            self.requests.finish(finished, now)
            self._free(np.array(done))
        self._preempt_overflow()
        self._observe(plan, accepted)
        return finished

    # ---- internals ----------------------------------------------------------------
    def _admit(self, now: float) -> None:
        table, capacity = self.requests, self.model.kv_capacity_tokens
        while self.waiting and self.free_slots:
            request = self.waiting[0]
            total = int(table.prompt_len[request]) + int(table.num_generated(request))
            if self.kv_used + total > capacity and self.num_running:
                break  # FCFS: no overtaking the head of the queue
            self.waiting.popleft()
            cached = self._cached_prefix(request)
            slot = self.free_slots.pop()
            self.req[slot] = request
            self.prefill_left[slot] = total - cached
            self.out_left[slot] = int(table.output_len[request]) - int(table.num_generated(request))
            self.context[slot] = cached
            self.admit_seq[slot] = self.num_admitted
            self.num_admitted += 1
            self.num_running += 1
            self.prefilling.append(slot)
            self.kv_used += total
            table.admitted(request, now)

    def _cached_prefix(self, request: int) -> int:
        """Tokens of the request's shared prefix this replica has cached (whole blocks,
        never the prompt's last token); records the prefix as cached from now on."""
        prefix = int(self.requests.prefix_id[request])
        if prefix < 0:
            return 0
        block = self.settings.block_size
        shared = min(int(self.requests.shared_len[request]), int(self.requests.prompt_len[request]) - 1)
        shared = shared // block * block
        hit = self.prefix_cache.get(prefix, 0)
        self.prefix_cache[prefix] = max(hit, shared)
        self.prefix_cache.move_to_end(prefix)
        while len(self.prefix_cache) > PREFIX_CACHE_ENTRIES:
            self.prefix_cache.popitem(last=False)
        return min(hit, shared)

    def _free(self, slots: np.ndarray) -> None:
        prefill_left = self.prefill_left[slots]
        self.kv_used -= int(np.add.reduce(self.context[slots]) + np.add.reduce(prefill_left))
        if prefill_left.any():
            for slot in slots[prefill_left > 0].tolist():
                self.prefilling.remove(slot)
        self.decoding[slots] = False
        self.req[slots] = -1
        self.prefill_left[slots] = 0
        self.out_left[slots] = 0
        self.context[slots] = 0
        self.free_slots.extend(slots.tolist())
        self.num_running -= len(slots)

    def _preempt_overflow(self) -> None:
        """Recompute-preempt the newest requests until the KV cache holds the rest (vLLM's
        default); a lone request is never preempted."""
        while self.kv_used > self.model.kv_capacity_tokens and self.num_running > 1:
            occupied = np.flatnonzero(self.req >= 0)
            slot = int(occupied[np.argmax(self.admit_seq[occupied])])
            request = int(self.req[slot])
            generated = int(self.requests.output_len[request]) - int(self.out_left[slot])
            self.requests.generated_before_preemption(request, generated)
            self._free(np.array([slot]))
            self.waiting.appendleft(request)
            self.num_preemptions += 1

    def _observe(self, plan: StepPlan, accepted: np.ndarray | None) -> None:
        num_prefill_tokens = sum(plan.prefill_chunks)
        num_seqs = len(plan.decode_slots) + len(plan.prefill_slots)
        self.tracker.observe(num_seqs, plan.k, num_prefill_tokens, plan.seconds)
        if plan.prefill_slots or not len(plan.decode_slots):
            return  # steps with prefill chunks are not what the latency model describes
        num_decode = len(plan.decode_slots)
        drafted = num_decode * self.model.drafted_per_request(plan.k) if self.model.coverage is not None else None
        if isinstance(self.controller, SimAdaptiveController):  # numpy's fast path
            self.controller.observe_arrays(num_decode, plan.k, plan.seconds, accepted, drafted)
            return
        drafts = [(plan.k, plan.k, a) for a in accepted.sum(axis=1).tolist()] if accepted is not None else []
        self.controller.observe(StepObservation(num_decode, plan.k, plan.seconds, drafts,
                                                None if drafted is None else round(drafted)))

    # ---- what the router sees -------------------------------------------------------
    def stats(self, now: float) -> ReplicaStats:
        """The replica's published stats, refreshed every ``stats_period_s``."""
        if self._stats is None or now - self._stats.timestamp >= self.settings.stats_period_s:
            size = self.settings.max_num_seqs
            hashes = frozenset(h for prefix, tokens in self.prefix_cache.items()
                               for h in prefix_hashes(prefix, tokens, self.settings))
            self._stats = ReplicaStats(
                replica_id=self.replica_id, group=self.group, device_kind=self.device_kind, timestamp=now,
                num_running=self.num_running, num_waiting=len(self.waiting), max_num_seqs=size,
                kv_cache_usage=min(1.0, self.kv_used / self.model.kv_capacity_tokens), current_k=self.last_k,
                acceptance=self.num_accepted / self.num_drafted if self.num_drafted else 0.0,
                step_time_curve=self.tracker.curve(self.last_k, size),
                prefill_seconds_per_token=self.tracker.prefill_seconds_per_token,
                speed_factor=self.tracker.speed_factor, cached_prefix_hashes=hashes,
                block_size=self.settings.block_size)
        return self._stats

    def check_invariants(self) -> None:
        occupied = self.req >= 0
        assert int(occupied.sum()) == self.num_running <= self.settings.max_num_seqs
        assert len(self.free_slots) == self.settings.max_num_seqs - self.num_running
        assert self.kv_used == int(self.context[occupied].sum() + self.prefill_left[occupied].sum())
        assert np.array_equal(self.decoding, occupied & (self.prefill_left == 0))
        pending = np.flatnonzero(occupied & (self.prefill_left > 0))
        assert self.prefilling == pending[np.argsort(self.admit_seq[pending], kind="stable")].tolist()
        assert self.num_running <= 1 or self.kv_used <= self.model.kv_capacity_tokens
        assert bool(np.all(self.out_left[occupied] > 0))


def prefix_hashes(prefix: int, tokens: int, settings: ReplicaSettings) -> tuple[int, ...]:
    """Stand-ins for the engine's chained block hashes of a shared prefix: one name per
    full block, at most ``prefix_affinity_blocks`` of them (a hit at i implies 0..i)."""
    num_blocks = min(tokens // settings.block_size, settings.prefix_affinity_blocks)
    return tuple(prefix * 4096 + i + 1 for i in range(num_blocks))
