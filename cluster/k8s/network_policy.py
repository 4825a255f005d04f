"""The NetworkPolicy of the Ray pods: without it, any pod in the Kubernetes cluster can reach the
head's dashboard and job API (port 8265: submit a Ray job, run anything) and GCS.

With it, the pods of this Ray cluster reach each other on every port (Ray's workers talk on
ports it picks), the KubeRay operator reaches the dashboard and GCS (it reads Serve's status
and the cluster's health), Prometheus the metrics ports, and everyone the API port (the Serve
Service's clients, an ingress controller). Probes from the kubelet are not subject to it.
"""

from __future__ import annotations

from cluster.config import TandemConfig
from cluster.k8s.pods import RayPorts, labels


def network_policy(config: TandemConfig) -> dict | None:
    k8s = config.kubernetes
    settings = k8s.network_policy
    if not settings.enabled:
        return None
    ports = RayPorts(serve=config.serve.port, metrics=config.serve.metrics_export_port)
    ray_pods = {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": k8s.name}

    def tcp(*numbers: int) -> list[dict]:
        return [{"protocol": "TCP", "port": n} for n in numbers]

    def pods_anywhere(selector: dict[str, str]) -> list[dict]:
        return [{"namespaceSelector": {}, "podSelector": {"matchLabels": dict(selector)}}]

    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"{k8s.name}-ray", "namespace": k8s.namespace, "labels": labels(k8s, "network-policy")},
        "spec": {
            "podSelector": {"matchLabels": dict(ray_pods)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": dict(ray_pods)}}]},
                {"ports": tcp(ports.serve)},
                {"from": pods_anywhere(settings.operator_pods), "ports": tcp(ports.dashboard, ports.gcs)},
                {"from": pods_anywhere(settings.prometheus_pods),
                 "ports": tcp(ports.serve, ports.metrics, ports.autoscaler_metrics, ports.dashboard_metrics)},
            ],
        },
    }
