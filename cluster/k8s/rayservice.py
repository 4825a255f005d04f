"""The RayService: a KubeRay-managed Ray cluster plus the Serve application on it.

``serveConfigV2`` is Ray Serve's deploy config (the ``serve deploy`` schema) as a YAML
string. It runs ``deployments.app:app_builder`` with the Tandem config inline
(``args: {config: {...}}``), without the ``kubernetes`` section. The Ray cluster has a
head group and one worker group per serve group; Ray's in-tree autoscaler adds and
removes worker pods as Serve's replica autoscaling asks for them. Each worker group
advertises ``accelerator_type:<kind>`` so that Serve's ``accelerator_type`` placement,
and the autoscaler's choice of group, work before any pod of that kind exists.
"""

from __future__ import annotations

import math

import yaml

from cluster.config import TandemConfig, config_from_dict
from cluster.k8s.pods import RayPorts, add_logs_sidecar, head_template, labels, worker_template
from cluster.k8s.plan import WorkerGroupPlan
from cluster.k8s.serve_bounds import split_bounds

APP_IMPORT_PATH = "deployments.app:app_builder"


def serve_config(config: TandemConfig, embedded: dict) -> dict:
    """Ray Serve's deploy config: one application, Tandem's builder, the config inline without
    the replica bounds, which the ``deployments:`` section carries (``serve_bounds.py``)."""
    serve = config_from_dict(embedded, "the embedded config").serve
    args, deployments = split_bounds(serve, embedded)
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": config.serve.port},
        "applications": [{
            "name": config.kubernetes.name,
            "route_prefix": "/",
            "import_path": APP_IMPORT_PATH,
            "args": {"config": args},
            "logging_config": serve.logging_config(),
            "deployments": deployments,
        }],
    }


def ray_service(config: TandemConfig, embedded: dict, plans: list[WorkerGroupPlan]) -> dict:
    """The RayService object; ``embedded`` is the Tandem config the replicas get."""
    k8s = config.kubernetes
    ports = RayPorts(serve=config.serve.port, metrics=config.serve.metrics_export_port)
    api_keys = config.serve.api_key_env is not None  # the render reads them from the Secret, mounted
    grace_s = int(config.serve.drain_timeout_s + 0.999) + 30  # the drain, then Serve and Ray stopping
    common_params = {"metrics-export-port": str(ports.metrics),
                     "dashboard-agent-listen-port": str(ports.dashboard_agent)}
    head = {
        "serviceType": "ClusterIP",
        # CPUs for one ingress replica (the ingress goes one per node): the API stays up while a worker drains.
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": str(math.ceil(config.serve.ingress_num_cpus)),
                           "num-gpus": "0", **common_params},
        "template": head_template(k8s, ports, api_keys, grace_s),
    }
    workers = []
    for plan in plans:
        group: dict = {
            "groupName": plan.name,
            "replicas": plan.initial_pods,
            "minReplicas": plan.min_pods,
            "maxReplicas": plan.max_pods,
        }
        if plan.pods.idle_timeout_s is not None:
            group["idleTimeoutSeconds"] = plan.pods.idle_timeout_s
        if plan.accelerator_type:
            group["resources"] = {f"accelerator_type:{plan.accelerator_type}": "1"}
        group["rayStartParams"] = {"num-gpus": str(plan.gpus_per_pod), **common_params}
        group["template"] = worker_template(k8s, plan, ports, api_keys, grace_s)
        workers.append(group)
    if k8s.logs_sidecar and config_from_dict(embedded, "the embedded config").serve.log_format == "json":
        for template in [head["template"]] + [group["template"] for group in workers]:
            add_logs_sidecar(k8s, template["spec"])
    serve_yaml = yaml.safe_dump(serve_config(config, embedded), sort_keys=False, width=100)
    cluster = {
        "rayVersion": k8s.ray_version,
        "enableInTreeAutoscaling": True,
        "autoscalerOptions": {"upscalingMode": "Default", "idleTimeoutSeconds": k8s.autoscaler_idle_timeout_s},
        "headGroupSpec": head,
        "workerGroupSpecs": workers,
    }
    if k8s.ray_auth == "token":
        cluster["authOptions"] = {"mode": "token"}
    if k8s.head_fault_tolerance is not None:
        cluster["gcsFaultToleranceOptions"] = gcs_fault_tolerance(k8s.head_fault_tolerance)
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": k8s.name, "namespace": k8s.namespace, "labels": labels(k8s, "rayservice")},
        "spec": {
            "serveService": {
                "metadata": {"name": f"{k8s.name}-serve", "labels": labels(k8s, "serve")},
                "spec": {"type": k8s.service_type,
                         "ports": [{"name": "serve", "port": ports.serve, "targetPort": "serve",
                                    "protocol": "TCP"}]},
            },
            "serveConfigV2": serve_yaml,
            "upgradeStrategy": upgrade_strategy(k8s.upgrades),
            "rayClusterConfig": cluster,
        },
    }


def upgrade_strategy(upgrades) -> dict:
    """RayService ``upgradeStrategy`` from ``kubernetes.upgrades``."""
    strategy: dict = {"type": upgrades.strategy}
    if upgrades.strategy == "NewClusterWithIncrementalUpgrade":
        strategy["clusterUpgradeOptions"] = {
            "gatewayClassName": upgrades.gateway_class_name, "intervalSeconds": upgrades.interval_seconds,
            "stepSizePercent": upgrades.step_size_percent, "maxSurgePercent": upgrades.max_surge_percent}
    return strategy


def gcs_fault_tolerance(options) -> dict:
    """RayCluster ``gcsFaultToleranceOptions``: the GCS in an external Redis."""
    result: dict = {"redisAddress": options.redis_address}
    if options.password_secret:
        result["redisPassword"] = {"valueFrom": {"secretKeyRef": {"name": options.password_secret,
                                                                   "key": "password"}}}
    return result
