"""Size the KubeRay worker group of each serve group.

A worker pod takes a whole node's GPUs (``gpus_per_node``) and holds as many replicas as
fit: ``replicas_per_pod = gpus_per_node // (tensor_parallel_size * num_gpus)`` (and as
many as its CPUs allow). The group's replica bounds then become pod bounds, rounded up:
``min_pods = ceil(min_replicas / replicas_per_pod)``, likewise for max and initial.
A replica never spans pods: its ranks are packed on one node (``STRICT_PACK``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.config import ConfigError, TandemConfig
from cluster.config_serve import ReplicaGroupConfig
from cluster.config_k8s import WorkerPods

GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"  # set by NVIDIA GPU Feature Discovery
GPU_TAINT = "nvidia.com/gpu"
SPARE_CPUS = 2  # default headroom per worker pod: Ray's own processes and the ingress replica
_EPS = 1e-9


@dataclass(frozen=True)
class WorkerGroupPlan:
    """One serve group's worker pods; counts are pods unless named per replica."""

    name: str
    accelerator_type: str | None
    gpus_per_replica: float  # tensor_parallel_size * num_gpus
    cpus_per_replica: float  # tensor_parallel_size * num_cpus
    gpus_per_pod: int
    cpus_per_pod: int
    replicas_per_pod: int
    min_pods: int
    max_pods: int
    initial_pods: int
    pods: WorkerPods  # memory, shm size, idle timeout as configured
    node_selector: dict[str, str]
    tolerations: list[dict]


def plan_worker_groups(config: TandemConfig) -> list[WorkerGroupPlan]:
    """One plan per serve group, in the config's order; ConfigError names the bad setting."""
    names = [g.name for g in config.serve.groups]
    unknown = sorted(set(config.kubernetes.groups) - set(names))
    if unknown:
        raise ConfigError(f"kubernetes.groups has {', '.join(unknown)}, which are not serve groups; "
                          f"serve groups: {', '.join(names)}")
    return [_plan(group, config.kubernetes.groups.get(group.name, WorkerPods())) for group in config.serve.groups]


def _plan(group: ReplicaGroupConfig, pods: WorkerPods) -> WorkerGroupPlan:
    where = f"kubernetes.groups.{group.name}"
    gpus_per_replica = group.tensor_parallel_size * group.num_gpus
    cpus_per_replica = group.tensor_parallel_size * group.num_cpus
    if gpus_per_replica == 0 and pods.gpus_per_node is not None:
        raise ConfigError(f"{where}.gpus_per_node is set but serve group {group.name!r} uses no GPU (num_gpus 0)")
    gpus_per_pod = pods.gpus_per_node if pods.gpus_per_node is not None else math.ceil(gpus_per_replica)
    fits = [math.floor(gpus_per_pod / gpus_per_replica + _EPS)] if gpus_per_replica else []
    if fits and fits[0] < 1:
        raise ConfigError(
            f"{where}.gpus_per_node is {gpus_per_pod} but one replica of serve group {group.name!r} needs "
            f"{gpus_per_replica:g} GPUs (tensor_parallel_size {group.tensor_parallel_size} x num_gpus "
            f"{group.num_gpus:g}) on one node; raise gpus_per_node")
    cpus_per_pod = _cpus(pods.cpu) if pods.cpu is not None else None
    if cpus_per_pod is not None and cpus_per_replica:
        fits.append(math.floor(cpus_per_pod / cpus_per_replica + _EPS))
        if fits[-1] < 1:
            raise ConfigError(f"{where}.cpu is {pods.cpu} but one replica of serve group {group.name!r} "
                              f"needs {cpus_per_replica:g} CPUs (tensor_parallel_size x num_cpus)")
    replicas_per_pod = min(fits) if fits else 1
    if cpus_per_pod is None:
        cpus_per_pod = math.ceil(replicas_per_pod * cpus_per_replica - _EPS) + SPARE_CPUS
    low, high, initial = _replica_bounds(group)
    gpu = gpus_per_replica > 0
    default_selector = {GPU_PRODUCT_LABEL: f"NVIDIA-{group.accelerator_type}"} if gpu and group.accelerator_type else {}
    default_tolerations = [{"key": GPU_TAINT, "operator": "Exists", "effect": "NoSchedule"}] if gpu else []
    return WorkerGroupPlan(
        name=group.name, accelerator_type=group.accelerator_type,
        gpus_per_replica=gpus_per_replica, cpus_per_replica=cpus_per_replica,
        gpus_per_pod=gpus_per_pod if gpu else 0, cpus_per_pod=cpus_per_pod, replicas_per_pod=replicas_per_pod,
        min_pods=math.ceil(low / replicas_per_pod), max_pods=max(1, math.ceil(high / replicas_per_pod)),
        initial_pods=math.ceil(initial / replicas_per_pod), pods=pods,
        node_selector=pods.node_selector if pods.node_selector is not None else default_selector,
        tolerations=([toleration_dict(t) for t in pods.tolerations] if pods.tolerations is not None
                     else default_tolerations),
    )


def _replica_bounds(group: ReplicaGroupConfig) -> tuple[int, int, int]:
    """(min, max, initial) replicas: the autoscaling bounds, or the fixed count three times."""
    scaling = group.autoscaling
    if scaling is None:
        return group.num_replicas, group.num_replicas, group.num_replicas
    initial = scaling.initial_replicas if scaling.initial_replicas is not None else scaling.min_replicas
    return scaling.min_replicas, scaling.max_replicas, initial


def _cpus(quantity: str) -> int:
    """Whole CPUs Ray sees in a container limit ("500m" -> 1, "7.5" -> 8, "16" -> 16)."""
    if quantity.endswith("m"):
        return max(1, math.ceil(float(quantity[:-1]) / 1000 - _EPS))
    if not quantity.replace(".", "", 1).isdigit():
        raise ConfigError(f"a CPU quantity is a number of CPUs or millicores like '500m', got {quantity!r}")
    return math.ceil(float(quantity) - _EPS)


def toleration_dict(toleration) -> dict:
    """A :class:`Toleration` in Kubernetes' spelling, unset fields left out."""
    data = toleration.model_dump(exclude_none=True)
    if "toleration_seconds" in data:
        data["tolerationSeconds"] = data.pop("toleration_seconds")
    return data
