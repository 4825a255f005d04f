"""The router policies the simulator compares, driven by simulated replica stats.

* ``tandem``: :func:`cluster.routing.policy.rank_replicas`, the code the Ray Serve router
  runs, on each candidate's published ``ReplicaStats`` (refreshed every
  ``routing_stats_period_s``, so as stale as in the cluster) and the router's own count
  of requests sent and not finished (``Candidate.num_inflight``).
* ``pow2``: :func:`cluster.routing.policy.power_of_two_choices` over two replicas drawn
  at random, by their live queue length (Ray Serve probes the replicas it picks).
* ``round-robin``: each replica in turn.
* ``prefix-affinity``: the replica whose published prefix hashes cover most of the
  prompt (:func:`cluster.routing.policy.matched_prefix_tokens`), ties and misses at
  random; load is ignored.

Above ``router_candidates`` replicas, ``tandem`` and ``prefix-affinity`` look at that
many drawn at random per request (a router that scores a thousand replicas per request
is not what anyone deploys; the draw keeps each decision O(candidates)).
"""

from __future__ import annotations

import random
from typing import Protocol

from cluster.routing.policy import matched_prefix_tokens, power_of_two_choices, rank_replicas
from cluster.routing.stats import Candidate, RoutingRequest
from cluster.sim.replica import ReplicaSettings, SimReplica, prefix_hashes
from cluster.sim.requests import RequestTable


class SimRouter(Protocol):
    def choose(self, replicas: list[SimReplica], request: int, now: float) -> SimReplica: ...


def routing_request(table: RequestTable, request: int, settings: ReplicaSettings) -> RoutingRequest:
    prefix = int(table.prefix_id[request])
    hashes = prefix_hashes(prefix, int(table.shared_len[request]), settings) if prefix >= 0 else ()
    return RoutingRequest(int(table.prompt_len[request]), int(table.output_len[request]), hashes)


class _Sampling:
    def __init__(self, rng: random.Random, max_candidates: int) -> None:
        self.rng, self.max_candidates = rng, max_candidates

    def candidates(self, replicas: list[SimReplica]) -> list[SimReplica]:
        if len(replicas) <= self.max_candidates:
            return replicas
        return [replicas[i] for i in self.rng.sample(range(len(replicas)), self.max_candidates)]


class TandemRouter(_Sampling):
    def __init__(self, rng: random.Random, max_candidates: int, table: RequestTable, settings: ReplicaSettings,
                 staleness_s: float) -> None:
        super().__init__(rng, max_candidates)
        self.table, self.settings, self.staleness_s = table, settings, staleness_s
        self.num_fallbacks = 0

    def choose(self, replicas: list[SimReplica], request: int, now: float) -> SimReplica:
        pool = self.candidates(replicas)
        candidates = [Candidate(r.replica_id, r.stats(now), r.num_running + len(r.waiting)) for r in pool]  # r.load
        result = rank_replicas(routing_request(self.table, request, self.settings), candidates, now, self.rng,
                               self.staleness_s)
        self.num_fallbacks += result.used_fallback
        best = result.replica_ids[0]
        return next(r for r in pool if r.replica_id == best)


class Pow2Router:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def choose(self, replicas: list[SimReplica], request: int, now: float) -> SimReplica:
        if len(replicas) == 1:
            return replicas[0]
        pair = [replicas[i] for i in self.rng.sample(range(len(replicas)), 2)]
        by_id = {r.replica_id: r for r in pair}
        order = power_of_two_choices([Candidate(r.replica_id, None, r.load) for r in pair], self.rng)
        return by_id[order[0]]


class RoundRobinRouter:
    def __init__(self) -> None:
        self.next = 0

    def choose(self, replicas: list[SimReplica], request: int, now: float) -> SimReplica:
        replica = replicas[self.next % len(replicas)]
        self.next += 1
        return replica


class PrefixAffinityRouter(_Sampling):
    def __init__(self, rng: random.Random, max_candidates: int, table: RequestTable,
                 settings: ReplicaSettings) -> None:
        super().__init__(rng, max_candidates)
        self.table, self.settings = table, settings

    def choose(self, replicas: list[SimReplica], request: int, now: float) -> SimReplica:
        pool = self.candidates(replicas)
        routing = routing_request(self.table, request, self.settings)
        if routing.prefix_hashes:
            matched = [matched_prefix_tokens(routing, r.stats(now)) for r in pool]
            best = max(matched)
            if best > 0:
                return self.rng.choice([r for r, m in zip(pool, matched) if m == best])
        return self.rng.choice(pool)


def build_router(name: str, seed: int, max_candidates: int, table: RequestTable, settings: ReplicaSettings,
                 staleness_s: float) -> SimRouter:
    rng = random.Random(seed)
    if name == "tandem":
        return TandemRouter(rng, max_candidates, table, settings, staleness_s)
    if name == "pow2":
        return Pow2Router(rng)
    if name == "round-robin":
        return RoundRobinRouter()
    if name == "prefix-affinity":
        return PrefixAffinityRouter(rng, max_candidates, table, settings)
    raise ValueError(f"unknown router policy {name!r}")
