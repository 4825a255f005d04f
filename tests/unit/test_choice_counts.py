"""The in-group router's counts (``cluster/routing/choice_counts.py``, at ``/debug/router``): each
generate call's ranking counted as ranked or fallen back, and whether the replica ranked first
holds the deepest cached prefix of the request."""

from __future__ import annotations

import random

from cluster.routing.policy import rank_replicas
from cluster.routing.stats import Candidate, ReplicaStats, RoutingRequest
from cluster.routing import choice_counts
from cluster.routing.choice_counts import count_choice

NOW = 1000.0


def _stats(replica_id: str, cached=frozenset(), timestamp: float = NOW - 1.0, running: int = 0) -> ReplicaStats:
    return ReplicaStats(replica_id=replica_id, group="g", device_kind="cpu", timestamp=timestamp,
                        num_running=running, num_waiting=0, max_num_seqs=8, kv_cache_usage=0.0, current_k=0,
                        acceptance=0.0, step_time_curve=((1, 0.02), (8, 0.05)), prefill_seconds_per_token=0.003,
                        block_size=16, cached_prefix_hashes=cached)


def test_choices_are_counted_by_how_they_were_made(monkeypatch):
    monkeypatch.setattr(choice_counts, "CHOICES", choice_counts.CHOICES.__class__())
    request = RoutingRequest(num_prompt_tokens=400, expected_output_tokens=16, prefix_hashes=(1, 2, 3, 4))
    warm = Candidate("warm", _stats("warm", frozenset({1, 2, 3})), 0)
    cold = Candidate("cold", _stats("cold", frozenset({1})), 0)
    busy_warm = Candidate("warm", _stats("warm", frozenset({1, 2, 3}), running=3), 0)
    stale = Candidate("stale", _stats("stale", timestamp=NOW - 60.0), 0)
    rng = random.Random(0)
    count_choice(rank_replicas(request, [warm, cold], NOW, rng))  # the deeper prefix first
    # 32 more tokens cached do not outweigh 3 requests running: the cold replica first
    assert rank_replicas(request, [busy_warm, cold], NOW, rng).replica_ids[0] == "cold"
    count_choice(rank_replicas(request, [busy_warm, cold], NOW, rng))
    count_choice(rank_replicas(RoutingRequest(400, 16), [warm, cold], NOW, rng))  # no prefix asked
    count_choice(rank_replicas(request, [warm, stale], NOW, rng))  # stale stats: power of two choices
    assert choice_counts.CHOICES == {"ranked": 3, "prefix_found": 2, "deepest_prefix_first": 1, "fallback": 1}
