"""Ray Serve's binding of Tandem's routing policy inside one replica group.

``TandemRequestRouter`` ranks the replicas of a deployment with
:func:`cluster.routing.policy.rank_replicas` from the ``ReplicaStats`` each replica
publishes (``record_routing_stats``), the requests this router has sent to each
(Serve's queue-length cache) and the request's leading block hashes (prefix-cache
affinity). Serve tries the ranks in order, so a replica at its
``max_ongoing_requests`` falls through to the next best. An ingress's delta feed
(``FeedRequest``) goes to the replica it names, a starting replica's ``WarmStartRequest``
to any other.
Every ranking is counted in :mod:`cluster.routing.choice_counts` (``/debug/router`` shows it).
"""

from __future__ import annotations

import random
import time
from typing import List, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from cluster.hosting.protocol import FeedRequest, GenerateRequest, WarmStartRequest
from cluster.routing import choice_counts
from cluster.routing.policy import power_of_two_choices, rank_replicas
from cluster.routing.stats import Candidate, ReplicaStats


class TandemRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, staleness_seconds: float = 5.0, seed: int | None = None) -> None:
        self.staleness_seconds = staleness_seconds
        self.rng = random.Random(seed)

    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        candidates = [self._candidate(r) for r in candidate_replicas]
        argument = _argument(pending_request)
        if isinstance(argument, FeedRequest):  # a feed goes to the replica it names (none else holds its deltas)
            return [[by_id[argument.replica_id]]] if argument.replica_id in by_id else [candidate_replicas]
        if isinstance(argument, WarmStartRequest):  # any replica but the one starting (it has nothing yet)
            others = [r for r in candidate_replicas if r.replica_id.unique_id != argument.replica_id]
            return [[r] for r in others or candidate_replicas]
        request = argument.routing if isinstance(argument, GenerateRequest) else None
        if request is not None and request.avoid_replica in by_id and len(by_id) > 1:  # a retry: elsewhere
            del by_id[request.avoid_replica]
            candidates = [c for c in candidates if c.replica_id != request.avoid_replica]
        if request is None:  # not a generate call (debug and health routes)
            order = power_of_two_choices(candidates, self.rng)
        else:
            ranked = rank_replicas(request, candidates, time.time(), self.rng, self.staleness_seconds)
            choice_counts.count_choice(ranked)
            order = ranked.replica_ids
        return [[by_id[replica_id]] for replica_id in order]

    def _candidate(self, replica: RunningReplica) -> Candidate:
        stats = None
        if replica.routing_stats:
            try:
                stats = ReplicaStats.from_dict(replica.routing_stats)
            except (TypeError, ValueError):
                stats = None
        inflight = self.replica_queue_len_cache.get(replica.replica_id) or 0
        return Candidate(replica.replica_id.unique_id, stats, inflight)


def _argument(pending_request: Optional[PendingRequest]):
    """The call's first argument (a ``GenerateRequest``, a ``FeedRequest``; None for other calls)."""
    if pending_request is None or not pending_request.args:
        return None
    return pending_request.args[0]
