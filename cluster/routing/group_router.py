"""Choosing a replica group for each request, at the ingress.

Each replica group is its own Serve deployment (replicas of one device kind), so the
choice between kinds of device happens before Ray Serve's per-deployment router runs.
The ingress sees every request it sends: it counts them in flight per group, and
every stream's acknowledgement carries the serving replica's ``ReplicaStats``. A group
is represented by its replicas' latest stats with the group's in-flight requests
spread evenly over them (the deployment's own router balances inside the group);
load is the ingress's count, since a replica's reported queue is a snapshot that
may predate the requests sent since. Several ingress replicas each balance their own
share of the traffic this way.

A group that has lost every running replica (``set_unavailable``, from Serve's own view) is
left out while another group can take the request, so traffic does not queue behind a
replica that is not coming back soon (a lost node). Serve's view lags: an acknowledgement
from one of the group's replicas after that view was read puts the group back at once.

Policies: ``tandem`` ranks replicas of all groups by predicted completion time
(:func:`rank_replicas`, which itself falls back to power-of-two choices when any
group has no fresh stats); ``pow2`` is power-of-two choices over the same replicas
by load, what Ray Serve's default router does within a deployment.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter
from typing import Callable, Iterable

from cluster.routing.policy import power_of_two_choices, rank_replicas
from cluster.routing.stats import Candidate, ReplicaStats, RoutingRequest


class GroupRouter:
    def __init__(self, group_sizes: dict[str, int], policy: str = "tandem", staleness_seconds: float = 5.0,
                 seed: int | None = None, on_decision: Callable[[str], None] | None = None,
                 on_retry: Callable[[str], None] | None = None) -> None:
        if policy not in ("tandem", "pow2"):
            raise ValueError(f"router policy must be 'tandem' or 'pow2', got {policy!r}")
        if not group_sizes:
            raise ValueError("a group router needs at least one replica group")
        self.group_sizes = dict(group_sizes)  # group -> configured number of replicas (a floor for spreading load)
        self.policy = policy
        self.staleness_seconds = staleness_seconds
        self.rng = random.Random(seed)
        self.inflight: Counter[str] = Counter()
        self.decisions: Counter[str] = Counter()
        self.unavailable: frozenset[str] = frozenset()  # groups with no running replica (set by the ingress)
        self._unavailable_as_of = 0.0  # when the view behind ``unavailable`` was read
        self.retries: Counter[str] = Counter()  # group -> requests its replicas failed and that were sent again
        self.fallbacks = 0
        self.on_decision = on_decision  # told the group of every decision (metrics)
        self.on_retry = on_retry  # told the group whose replica failed a request that is sent again (metrics)
        self._stats: dict[str, ReplicaStats] = {}  # replica id -> latest stats

    def observe(self, stats: ReplicaStats) -> None:
        known = self._stats.get(stats.replica_id)
        if known is None or known.timestamp <= stats.timestamp:
            self._stats[stats.replica_id] = stats
        if stats.group in self.unavailable and stats.timestamp >= self._unavailable_as_of:
            self.unavailable = self.unavailable - {stats.group}  # it answered after the view was read

    def choose(self, requests: dict[str, RoutingRequest], now: float) -> str:
        """The group for a request; ``requests`` holds its description per group (the
        prefix hashes differ between groups whose engines hash with different seeds)."""
        groups = [g for g in self.group_sizes if g in requests]
        if not groups:
            raise ValueError(f"no known replica group among {sorted(requests)}; groups: {sorted(self.group_sizes)}")
        groups = [g for g in groups if g not in self.unavailable] or groups
        if len(groups) == 1:
            return self._decide(groups[0])
        candidates: dict[str, list[Candidate]] = {}
        for group in groups:
            candidates[group] = self._candidates(group, now)
        everyone = [c for group in groups for c in candidates[group]]
        owner = {c.replica_id: group for group in groups for c in candidates[group]}
        if self.policy == "pow2":
            order = power_of_two_choices(everyone, self.rng)
            return self._decide(owner[order[0]])
        best_by_group = {}
        for group in groups:
            result = rank_replicas(requests[group], candidates[group], now, self.rng, self.staleness_seconds)
            if result.used_fallback:
                self.fallbacks += 1
                order = power_of_two_choices(everyone, self.rng)
                return self._decide(owner[order[0]])
            best_by_group[group] = result.predicted_seconds[result.replica_ids[0]]
        lowest = min(best_by_group.values())
        tied = [g for g, t in best_by_group.items() if t <= lowest * (1 + 1e-9)]
        return self._decide(self.rng.choice(tied))

    def on_finish(self, group: str) -> None:
        if self.inflight[group] > 0:
            self.inflight[group] -= 1

    def set_unavailable(self, groups: set[str], as_of: float) -> None:
        """The groups that had no running replica in Serve's view read at ``as_of`` (all others had one)."""
        self.unavailable, self._unavailable_as_of = frozenset(groups), as_of

    def may_leave(self, group: str, groups: Iterable[str]) -> bool:
        """Whether a request sent to ``group`` should go elsewhere: the group has lost its running
        replicas and another of the request's ``groups`` has one."""
        return group in self.unavailable and any(g not in self.unavailable for g in groups if g != group)

    def note_retry(self, failed_group: str) -> None:
        """A replica of ``failed_group`` failed a request before its first token; it is being sent again."""
        self.retries[failed_group] += 1
        if self.on_retry is not None:
            self.on_retry(failed_group)

    def snapshot(self) -> dict:
        return {
            "policy": self.policy,
            "decisions": dict(self.decisions),
            "retries": dict(self.retries),
            "unavailable": sorted(self.unavailable),
            "inflight": dict(self.inflight),
            "fallbacks": self.fallbacks,
            "replicas": {rid: {"group": s.group, "device_kind": s.device_kind, "speed_factor": s.speed_factor,
                               "current_k": s.current_k, "acceptance": s.acceptance,
                               "step_time_curve": [list(point) for point in s.step_time_curve],
                               "prefill_seconds_per_token": s.prefill_seconds_per_token}
                         for rid, s in self._stats.items()},
        }

    def _decide(self, group: str) -> str:
        self.decisions[group] += 1
        self.inflight[group] += 1
        if self.on_decision is not None:
            self.on_decision(group)
        return group

    def _candidates(self, group: str, now: float) -> list[Candidate]:
        fresh = [s for s in self._stats.values()
                 if s.group == group and now - s.timestamp <= self.staleness_seconds]
        if not fresh:
            # Unknown replicas: placeholders that make the policy fall back.
            size = max(1, self.group_sizes[group])
            share = math.ceil(self.inflight[group] / size)
            return [Candidate(f"{group}#{i}", None, share) for i in range(size)]
        # Replicas that have not reported yet still take their part of the load.
        share = math.ceil(self.inflight[group] / max(len(fresh), self.group_sizes[group]))
        # Load is our own count; the snapshot's queue may be older than our sends.
        return [Candidate(s.replica_id, dataclasses.replace(s, num_running=0, num_waiting=0), share)
                for s in fresh]
