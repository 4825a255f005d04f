"""The event loop: arrivals, step completions, replicas becoming ready, autoscaling ticks.

Events are taken in time order; at equal times a step's end comes first (it frees
capacity), then a replica becoming ready, then an arrival, then an autoscaling tick.
Arrivals are read from the workload's sorted array; step ends and readiness sit in a
heap (one pending step end per busy replica, so the heap holds at most one entry per
replica). A replica that ends a step starts its next one at once if it has work; an
idle replica starts when a request reaches it. Everything random comes from
generators seeded from ``SimConfig.seed``: the same config gives the same result.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from cluster.routing.step_times import StepTimeTracker
from cluster.sim.autoscale import GroupAutoscaler
from cluster.sim.config import GroupConfig, SimConfig
from cluster.sim.controllers import build_controller
from cluster.sim.device_model import StepModel, controller_prior
from cluster.sim.replica import ReplicaSettings, SimReplica
from cluster.sim.requests import RequestTable
from cluster.sim.routers import build_router
from cluster.sim.workload import Workload
from cluster.spec_decode.profile_data import SpeculationProfile

_STEP, _READY = 0, 1


@dataclass
class ReplicaLife:
    replica: SimReplica
    created_s: float
    ready_s: float
    stopped_s: float = float("nan")
    draining: bool = False


@dataclass
class GroupRuntime:
    config: GroupConfig
    model: StepModel
    settings: ReplicaSettings
    autoscaler: GroupAutoscaler | None
    lives: list[ReplicaLife] = field(default_factory=list)

    def live(self) -> list[ReplicaLife]:
        """Replicas not draining and not stopped (starting ones included)."""
        return [life for life in self.lives if not life.draining and np.isnan(life.stopped_s)]


@dataclass(frozen=True)
class SimResult:
    router: str
    controller: str
    requests: RequestTable
    groups: list[GroupRuntime]
    end_s: float
    wall_seconds: float
    num_events: int
    router_fallbacks: int


class Simulation:
    def __init__(self, config: SimConfig, models: dict[str, StepModel], workload: Workload, router: str,
                 controller: str, show_progress: bool = False, check_invariants: bool = False) -> None:
        self.config, self.controller_name, self.router_name = config, controller, router
        self.check_invariants = check_invariants  # tests: check every replica after each of its steps
        self.show_progress = show_progress
        self.table = RequestTable(workload)
        sched = config.scheduling
        self.groups = [GroupRuntime(
            g, models[g.name],
            ReplicaSettings(g.max_num_seqs, sched.max_num_batched_tokens, sched.block_size,
                            sched.prefix_affinity_blocks, sched.routing_stats_period_s, g.step_time_scale,
                            g.step_noise),
            GroupAutoscaler(g.autoscaling, sched.autoscale_period_s) if g.autoscaling else None)
            for g in config.groups]
        self.rng = np.random.default_rng([config.seed, 2])
        self.router = build_router(router, config.seed, sched.router_candidates, self.table,
                                   self.groups[0].settings, sched.routing_staleness_s)
        self.replicas: list[SimReplica] = []
        self.lives: list[ReplicaLife] = []  # parallel to replicas
        self.active: list[SimReplica] = []
        self.pending: deque[int] = deque()  # requests waiting at the router for a first replica
        self.heap: list[tuple[float, int, int, int]] = []
        self._seq = 0
        self._priors = {g.config.name: self._prior(g) for g in self.groups}

    # ---- replicas -----------------------------------------------------------------------
    def _prior(self, group: GroupRuntime):
        prior, acceptance, coverage = controller_prior(group.config, group.model)
        table = None
        if group.config.controller_profile:
            table = SpeculationProfile.load(group.config.controller_profile).table
        return prior, acceptance, coverage, table

    def _new_replica(self, group: GroupRuntime, now: float, ready_s: float) -> ReplicaLife:
        prior, acceptance, coverage, table = self._priors[group.config.name]
        controller = build_controller(self.controller_name, prior, acceptance, self.config.scheduling.max_k,
                                      group.config.max_num_seqs, table, coverage=coverage)
        # The group's profile whatever the controller, as the engine core builds it.
        tracker = StepTimeTracker(prior, coverage)
        index = len(self.replicas)
        replica = SimReplica(f"{group.config.name}-{index}", group.config.name, group.config.device, group.model,
                             controller, tracker, group.settings, self.table, self.rng)
        self.replicas.append(replica)
        life = ReplicaLife(replica, now, ready_s)
        self.lives.append(life)
        group.lives.append(life)
        return life

    def _refresh_active(self) -> None:
        self.active = [life.replica for g in self.groups for life in g.lives
                       if not life.draining and np.isnan(life.stopped_s) and life.ready_s <= self._now]

    def _push(self, at: float, kind: int, payload: int) -> None:
        heapq.heappush(self.heap, (at, kind, self._seq, payload))
        self._seq += 1

    # ---- events ---------------------------------------------------------------------------
    def _start(self, replica: SimReplica, index: int, now: float) -> None:
        end = replica.start_step(now)
        if end is not None:
            self._push(end, _STEP, index)

    def _tick(self, now: float) -> None:
        changed = False
        for group in self.groups:
            if group.autoscaler is None:
                continue
            live = group.live()
            ongoing = sum(life.replica.load for life in group.lives if np.isnan(life.stopped_s)) + len(self.pending)
            target = group.autoscaler.decide(ongoing, len(live))
            if target > len(live):
                for _ in range(target - len(live)):
                    life = self._new_replica(group, now, now + self.config.scheduling.replica_startup_s)
                    self._push(life.ready_s, _READY, len(self.replicas) - 1)
            elif target < len(live):
                # Starting replicas go first, then the least loaded.
                order = sorted(live, key=lambda life: (life.ready_s <= now, life.replica.load))
                for life in order[: len(live) - target]:
                    life.draining = True
                    if not life.replica.busy and life.replica.load == 0:
                        life.stopped_s = now
                changed = True
        if changed:
            self._refresh_active()

    def _stop_if_drained(self, index: int, now: float) -> None:
        life = self.lives[index]
        if life.draining and np.isnan(life.stopped_s):
            life.stopped_s = now

    # ---- the loop ---------------------------------------------------------------------
    def run(self) -> SimResult:
        started = time.perf_counter()
        self._now = 0.0
        for group in self.groups:
            count = group.autoscaler.initial_replicas() if group.autoscaler else group.config.num_replicas
            for _ in range(count):
                self._new_replica(group, 0.0, 0.0)
        self._refresh_active()
        index_of = {id(r): i for i, r in enumerate(self.replicas)}
        arrivals = self.table.arrival_s.tolist()  # Python floats: every time derived from them stays one
        n = len(arrivals)
        horizon = self._horizon()
        period = self.config.scheduling.autoscale_period_s
        autoscaling = any(g.autoscaler for g in self.groups)
        next_tick = period if autoscaling else np.inf
        i = num_finished = num_events = 0
        progress = tqdm(total=n, disable=not self.show_progress, desc=f"{self.router_name}/{self.controller_name}",
                        unit="req", mininterval=0.5)
        while True:
            t_heap = self.heap[0][0] if self.heap else np.inf
            t_arrival = arrivals[i] if i < n else np.inf
            if autoscaling and (i < n or num_finished < n or next_tick <= horizon):
                t_tick = next_tick
            else:
                t_tick = np.inf
            now = min(t_heap, t_arrival, t_tick)
            if now == np.inf:
                break
            self._now = now
            num_events += 1
            if t_heap == now:
                _, kind, _, index = heapq.heappop(self.heap)
                replica = self.replicas[index]
                if kind == _STEP:
                    finished = len(replica.finish_step(now))
                    if self.check_invariants:
                        replica.check_invariants()
                    if finished:
                        num_finished += finished
                        progress.update(finished)
                    self._start(replica, index, now)
                    if not replica.busy:
                        self._stop_if_drained(index, now)
                else:
                    self._refresh_active()
                    while self.pending and self.active:
                        self._route_known(self.pending.popleft(), now, index_of)
            elif t_arrival == now:
                self._route_known(i, now, index_of)
                i += 1
            else:
                self._tick(now)
                index_of = {id(r): j for j, r in enumerate(self.replicas)}
                next_tick += period
        progress.close()
        end = max(float(np.nanmax(self.table.finish_s)) if n else 0.0, self._now)
        for group in self.groups:
            for life in group.lives:
                if np.isnan(life.stopped_s):
                    life.stopped_s = max(end, life.created_s)
        fallbacks = getattr(self.router, "num_fallbacks", 0)
        return SimResult(self.router_name, self.controller_name, self.table, self.groups, end,
                         time.perf_counter() - started, num_events, fallbacks)

    def _route_known(self, request: int, now: float, index_of: dict[int, int]) -> None:
        if not self.active:
            self.pending.append(request)
            return
        replica = self.router.choose(self.active, request, now)
        index = index_of[id(replica)]
        self.table.replica[request] = index
        replica.enqueue(request)
        if not replica.busy:
            self._start(replica, index, now)

    def _horizon(self) -> float:
        phases = self.config.workload.phases
        return sum(p.duration_s for p in phases) if phases else 0.0


def simulate(config: SimConfig, models: dict[str, StepModel], workload: Workload, router: str, controller: str,
             show_progress: bool = False) -> SimResult:
    return Simulation(config, models, workload, router, controller, show_progress).run()

