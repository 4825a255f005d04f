"""How a replica group's router made its choices, counted in this process.

Each generate call's ranking (:func:`~cluster.routing.policy.rank_replicas`) counts as
``ranked`` (the cost model ordered the replicas) or ``fallback`` (a candidate's stats were
missing, had no step-time curve yet, or were older than the staleness bound: power of two
choices); of the ranked ones, ``prefix_found`` counts those where some replica holds a cached
prefix of the request and ``deepest_prefix_first`` those where the replica ranked first holds
the deepest one. The ingress shows the counts at ``/debug/router``. Ray Serve may carry the
router's class to the ingress by value, with copies of its module's globals, so callers reach
:data:`CHOICES` through this module (an import), never a name bound at import time.
"""

from __future__ import annotations

from collections import Counter

from cluster.routing.policy import RankResult

CHOICES: Counter = Counter()


def count_choice(ranked: RankResult) -> None:
    """Count one generate call's ranking in :data:`CHOICES`."""
    if ranked.used_fallback:
        CHOICES["fallback"] += 1
        return
    CHOICES["ranked"] += 1
    deepest = max((cost.matched_tokens for cost in ranked.costs.values()), default=0)
    if deepest > 0:
        CHOICES["prefix_found"] += 1
        if ranked.costs[ranked.replica_ids[0]].matched_tokens == deepest:
            CHOICES["deepest_prefix_first"] += 1
