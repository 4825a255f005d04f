"""One-off Jobs that measure each GPU kind's speculation profile on a node of that kind.

The ``table`` and ``adaptive`` controllers read a profile per serve group (its
``profile``, else ``speculative.profile``), measured by ``tandem profile CONFIG --group
NAME`` on that group's device. Each Job runs exactly that on a node the group's worker
pods would use (same node selector, tolerations and GPUs per replica) and writes the
JSON to the path the config names, on the weights volume, which this Job alone mounts
read-write. The config comes from a ConfigMap holding the same inline config as the
RayService. Groups without a profile path get no Job.
"""

from __future__ import annotations

import math

import yaml

from cluster.config import TandemConfig
from cluster.k8s.pods import environment, labels, model_volume, shm_volume
from cluster.k8s.plan import WorkerGroupPlan

CONFIG_KEY = "tandem.yaml"
CONFIG_MOUNT = "/etc/tandem"


def config_map(config: TandemConfig, embedded: dict) -> dict:
    k8s = config.kubernetes
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{k8s.name}-config", "namespace": k8s.namespace, "labels": labels(k8s, "config")},
        "data": {CONFIG_KEY: yaml.safe_dump(embedded, sort_keys=False, width=100)},
    }


def profile_path(config: TandemConfig, group_name: str) -> str | None:
    group = next(g for g in config.serve.groups if g.name == group_name)
    return group.profile or config.speculative.profile


def profile_job(config: TandemConfig, plan: WorkerGroupPlan) -> dict | None:
    """The Job that profiles ``plan``'s group, or None when the group names no profile."""
    out = profile_path(config, plan.name)
    if out is None:
        return None
    k8s = config.kubernetes
    models, models_mount = model_volume(k8s, read_only=False)
    shm, shm_mount = shm_volume(plan.pods.shm_size)
    config_volume = {"name": "tandem-config", "configMap": {"name": f"{k8s.name}-config"}}
    size = {"cpu": str(max(1, math.ceil(plan.cpus_per_replica))), "memory": plan.pods.memory}
    limits = dict(size)
    if plan.gpus_per_replica:
        limits["nvidia.com/gpu"] = str(math.ceil(plan.gpus_per_replica))
    container = {
        "name": "profile",
        "image": k8s.image,
        "imagePullPolicy": k8s.image_pull_policy,
        "command": ["tandem", "profile", f"{CONFIG_MOUNT}/{CONFIG_KEY}", "--group", plan.name, "--out", out],
        "env": environment(k8s),
        "resources": {"requests": size, "limits": limits},
        "volumeMounts": [models_mount, shm_mount,
                         {"name": "tandem-config", "mountPath": CONFIG_MOUNT, "readOnly": True}],
    }
    spec: dict = {"restartPolicy": "Never", "containers": [container], "volumes": [models, shm, config_volume]}
    if plan.node_selector:
        spec["nodeSelector"] = dict(plan.node_selector)
    if plan.tolerations:
        spec["tolerations"] = [dict(t) for t in plan.tolerations]
    job_labels = labels(k8s, "profile") | {"tandem/group": plan.name}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": f"{k8s.name}-profile-{plan.name}", "namespace": k8s.namespace, "labels": job_labels},
        "spec": {"backoffLimit": 0, "ttlSecondsAfterFinished": 86400,
                 "template": {"metadata": {"labels": job_labels}, "spec": spec}},
    }
