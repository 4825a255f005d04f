"""Tensor-parallel worker ranks of a Serve replica, as Ray actors in its placement group.

A replica group with ``tensor_parallel_size`` N gets a placement group of N bundles
(``deployments/app.py``); Serve puts the replica itself (rank 0, the driver) in bundle
0, and :class:`RayLauncher` puts rank ``r`` in bundle ``r`` with the same resources.
Each actor runs :func:`cluster.runner.tp_rank.run_worker` as one long call; the
driver's liveness check asks Ray whether that call has ended (the actor died or the
rank stopped), without a round trip to the actor.
"""

from __future__ import annotations

import uuid

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config import TandemConfig
from cluster.parallel.group import StoreAddress
from cluster.runner.tp_rank import run_worker

RANK_NAME_PREFIX = "tandem-tp-rank"


@ray.remote
class TensorParallelRank:
    def run(self, config: TandemConfig, rank: int, address: StoreAddress, device: str) -> None:
        run_worker(config, rank, address, device)


class ActorRank:
    """A :class:`cluster.runner.tp_launcher.RankProcess` backed by an actor's running call."""

    def __init__(self, actor, running: ray.ObjectRef) -> None:
        self.actor = actor
        self.running = running

    def is_alive(self) -> bool:
        done, _ = ray.wait([self.running], timeout=0)
        return not done

    def exit_reason(self) -> str:
        try:
            ray.get(self.running, timeout=0)
        except Exception as err:  # RayActorError when the actor died, the rank's own error otherwise
            return f"Ray actor failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        return "Ray actor's rank loop returned"

    def join(self, timeout_s: float) -> None:
        ray.wait([self.running], timeout=timeout_s)

    def terminate(self) -> None:
        ray.kill(self.actor)


class RayLauncher:
    """Starts rank ``r`` as an actor in bundle ``r`` of the current placement group (the
    replica's), each with ``num_cpus``/``num_gpus``; Ray gives each its own GPU."""

    isolates_devices = True

    def __init__(self, num_cpus: float, num_gpus: float) -> None:
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.placement_group = get_current_placement_group()
        self.store_host = ray.util.get_node_ip_address()

    def launch(self, config: TandemConfig, rank: int, address: StoreAddress, device: str) -> ActorRank:
        # Named, so operators (and tests) can find a replica's ranks.
        options: dict = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus,
                         "name": f"{RANK_NAME_PREFIX}{rank}-{uuid.uuid4().hex[:8]}"}
        if self.placement_group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=rank
            )
        actor = TensorParallelRank.options(**options).remote()
        return ActorRank(actor, actor.run.remote(config, rank, address, device))
