"""One Serve replica: the engine backend of one replica group (Tandem's or vLLM's).

The replica knows only ``EngineBackend`` (``cluster/engine/backend.py``); the group's
``engine.backend`` setting picks the implementation. Streams ``GenerateDelta``s: first an
acknowledgement (or an error, when the engine rejects the request), then the tokens.
A request that names a feed (``GenerateRequest.feed``) gets only the acknowledgement on
its stream, which stays open until the request ends; its token deltas wait in the feed's
``FeedOutbox`` for the ingress's ``feed`` call, which takes them for all its requests at
once. When the caller goes away, Ray Serve cancels the stream, which aborts the request in
the engine and frees its blocks. Publishes ``ReplicaStats`` for the router through
``record_routing_stats``. A replica with suffix drafts asks another of its group, once it has
started, for its latest responses and seeds its own trees with them (a warm start).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

import torch
from ray import serve

from cluster.backends.factory import build_backend
from cluster.config import TandemConfig, config_from_dict, group_engine_config, with_overrides
from cluster.hosting.backend import BackendContext, EngineUnhealthyError
from cluster.hosting.feed_outbox import FeedOutbox
from cluster.hosting.protocol import FeedRequest, GenerateDelta, GenerateRequest, WarmStartRequest
from cluster.routing.policy import saturation_batch
from cluster.routing.stats import ReplicaStats
from cluster.metrics.prometheus_sink import PrometheusSink
from deployments.app_hub import HubReporter
from deployments.autoscaling_policy import LOAD_METRIC
from deployments.tp_ranks import RayLauncher

logger = logging.getLogger(__name__)

# A feed with nothing to carry and no request in flight ends after this long (its ingress opens
# another with its next request here), so an idle ingress holds no call on the replica.
FEED_IDLE_SECONDS = 2.0
# How long a starting replica waits for another to answer its warm start before it stays cold.
WARM_START_SECONDS = 60.0


class TandemReplica:
    def __init__(self, config: dict, group_name: str) -> None:
        full = config_from_dict(config, "replica config")
        self.config: TandemConfig = group_engine_config(full, group_name)
        self.group = self.config.serve.groups[0]
        if self.config.device.num_threads is None and self.group.num_gpus == 0:
            # A CPU replica computes with as many threads as Ray reserved CPUs for it.
            self.config = with_overrides(self.config, num_threads=max(1, int(self.group.num_cpus)))
        self.prefix_depth = full.serve.prefix_affinity_blocks
        self.metrics = PrometheusSink("replica", {
            "model_name": full.serve.served_model_name or full.model.model, "group": self.group.name,
            "device_kind": self.group.device_kind})
        context = BackendContext(metrics_sink=self.metrics, tp_launcher=self._tp_launcher)
        self.backend = build_backend(self.config, self.group, context)
        self._reporter = None
        try:
            replica = serve.get_replica_context()
        except Exception:  # constructed outside Serve (unit tests)
            replica = None
            self.replica_id = f"{group_name}-local"
        else:
            self.replica_id = replica.replica_id.unique_id
            self._reporter = HubReporter(replica.app_name, {
                "application": replica.app_name, "deployment": replica.deployment, "replica": self.replica_id},
                self.metrics.exposition)
        self._outboxes: dict[str, FeedOutbox] = {}
        self._warm_start_task = None
        spec = self.config.speculative
        if (replica is not None and self.backend.name == "native" and spec.method == "suffix"
                and spec.suffix_warm_start_requests > 0):
            # Serve calls a constructor on its user-code event loop: the warm start runs there, after it.
            self._warm_start_task = asyncio.get_running_loop().create_task(
                self._warm_start(replica.app_name, replica.deployment, spec.suffix_warm_start_requests))
        logger.info("replica %s of group %s ready (%s engine, %s, %d torch threads)", self.replica_id, group_name,
                    self.backend.name, self.config.model.model, torch.get_num_threads())

    async def _warm_start(self, app_name: str, deployment: str, max_requests: int) -> None:
        """Seed the suffix trees with another replica's latest responses; best effort: with no other
        replica, nothing to give, or no answer in WARM_START_SECONDS, this one starts cold."""
        try:
            handle = serve.get_deployment_handle(deployment, app_name)
            response = handle.suffix_history.remote(WarmStartRequest(self.replica_id, max_requests))
            answer = await asyncio.wait_for(response, WARM_START_SECONDS)
            if answer["replica_id"] == self.replica_id or not answer["responses"]:
                logger.info("replica %s starts with cold suffix trees: no other replica had responses to give",
                            self.replica_id)
                return
            taken = await self.backend.seed_suffix(answer["responses"])
            logger.info("replica %s seeded its suffix trees with %d responses of replica %s", self.replica_id,
                        taken, answer["replica_id"])
        except Exception as err:  # a warm start only speeds drafting up: never fail the replica for it
            logger.warning("replica %s starts with cold suffix trees: %s: %s", self.replica_id,
                           type(err).__name__, err)

    async def suffix_history(self, request: WarmStartRequest) -> dict:
        """Another replica's warm start: up to ``request.max_requests`` of this one's latest finished
        responses, oldest first (none for the asker itself)."""
        responses = [] if request.replica_id == self.replica_id else \
            await self.backend.suffix_history(request.max_requests)
        return {"replica_id": self.replica_id, "responses": responses}

    def _tp_launcher(self):
        """Further tensor-parallel ranks run as Ray actors in this replica's placement group."""
        return RayLauncher(self.group.num_cpus, self.group.num_gpus)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        outbox = None if request.feed is None else self._outbox(request.feed)
        if outbox is not None:
            outbox.live += 1
        acknowledged = finished = False
        try:
            async for delta in self.backend.generate(request):
                if delta.accepted:
                    delta.replica_stats = self.record_routing_stats()
                if not acknowledged:
                    delta.replica_id = self.replica_id
                if outbox is None or not acknowledged:  # the acknowledgement (or refusal) is the call's
                    acknowledged = True
                    yield delta
                else:
                    outbox.put(request.request_id, delta)
                    finished = delta.finished
        finally:
            if outbox is not None:
                outbox.live -= 1
                if not finished:
                    outbox.drop(request.request_id)
                self._forget_if_idle(request.feed)

    async def feed(self, subscription: FeedRequest) -> AsyncIterator[list[tuple[str, GenerateDelta]]]:
        """The token deltas of this replica's requests that name ``subscription.feed_id``, all that
        waited in each item; ends after FEED_IDLE_SECONDS with none in flight (or at once where the
        router sent it to another replica than it names)."""
        if subscription.replica_id != self.replica_id:
            return
        outbox = self._outbox(subscription.feed_id)
        outbox.readers += 1
        try:
            while (items := await outbox.take(FEED_IDLE_SECONDS)) is not None:
                yield items
        finally:
            outbox.readers -= 1
            self._forget_if_idle(subscription.feed_id)

    def _outbox(self, feed_id: str) -> FeedOutbox:
        outbox = self._outboxes.get(feed_id)
        if outbox is None:
            outbox = self._outboxes[feed_id] = FeedOutbox()
        return outbox

    def _forget_if_idle(self, feed_id: str) -> None:
        outbox = self._outboxes.get(feed_id)
        if outbox is not None and outbox.idle:
            del self._outboxes[feed_id]

    def record_routing_stats(self) -> dict:
        load = self.backend.load(self.prefix_depth)
        stats = ReplicaStats(replica_id=self.replica_id, group=self.group.name, device_kind=self.group.device_kind,
                             timestamp=time.time(), **vars(load))
        return stats.to_dict()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """For the capacity autoscaling policy (``autoscaling_policy.py``): requests over the batch size
        where this replica's predicted throughput levels off."""
        load = self.backend.load(0)
        knee = saturation_batch(load.step_time_curve, load.acceptance, load.current_k) or load.max_num_seqs
        return {LOAD_METRIC: (load.num_running + load.num_waiting) / max(1, knee)}

    def capacity_tokens_per_second(self) -> float:
        return self.backend.capacity_tokens_per_second()

    async def engine_stats(self) -> dict:
        """Debug view: the engine's counters (the native engine checks its invariants first, and
        with an adaptive controller says what it has learnt) and the speculation in force."""
        return {"replica_id": self.replica_id, "group": self.group.name, **(await self.backend.engine_stats()),
                "speculation": self.spec_state()}

    async def step_timeline(self, last_seconds: float | None = None) -> dict:
        """Debug view: the engine core's recent steps and where their time went (summarized over the
        last ``last_seconds``, or every step kept)."""
        return {"replica_id": self.replica_id, "group": self.group.name,
                **(await self.backend.step_timeline(last_seconds))}

    def spec_state(self) -> dict:
        return vars(self.backend.spec_state())

    def check_health(self) -> None:
        try:
            self.backend.check_health()
        except EngineUnhealthyError as err:
            raise RuntimeError(f"replica {self.replica_id} is unhealthy: {err}") from None

    async def __del__(self) -> None:
        # Serve has already waited graceful_shutdown_timeout_s for in-flight requests.
        reporter = getattr(self, "_reporter", None)
        if reporter is not None:
            reporter.stop()
        backend = getattr(self, "backend", None)  # absent when __init__ failed
        if backend is not None:
            await backend.shutdown()
