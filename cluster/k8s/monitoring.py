"""PodMonitors (prometheus-operator) for the Ray head and the Ray workers.

Tandem's metrics (vLLM's ``vllm:*`` series and Tandem's ``tandem:*``, every replica's and
ingress's) are served by the ingress at ``/metrics`` on the API port: the head's PodMonitor
scrapes them once, through the head's Serve proxy (scraping every pod's proxy would repeat
each series per pod). Every Ray node exports Ray's and Serve's own metrics on
``serve.metrics_export_port`` (``ray start --metrics-export-port``), a container port named
``metrics``; the head also serves the autoscaler's and the dashboard's. Each scraped series
gets ``ray_io_cluster`` (the label Ray's own Grafana dashboards filter by) and the worker
series ``ray_group`` (the serve group, i.e. the GPU kind).
"""

from __future__ import annotations

from cluster.config_k8s import KubernetesConfig
from cluster.k8s.pods import labels


def _relabel(pod_label: str, target: str) -> dict:
    source = "__meta_kubernetes_pod_label_" + "".join(c if c.isalnum() else "_" for c in pod_label)
    return {"sourceLabels": [source], "targetLabel": target, "action": "replace"}


def _pod_monitor(k8s: KubernetesConfig, name: str, node_type: str, ports: list[str],
                 relabelings: list[dict]) -> dict:
    selector = {"app.kubernetes.io/instance": k8s.name, "ray.io/node-type": node_type}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": name, "namespace": k8s.namespace,
                     "labels": labels(k8s, "monitoring") | k8s.monitoring.labels},
        "spec": {
            "selector": {"matchLabels": selector},
            "namespaceSelector": {"matchNames": [k8s.namespace]},
            "podMetricsEndpoints": [
                {"port": port, "path": "/metrics", "interval": k8s.monitoring.interval,
                 "relabelings": [dict(r) for r in relabelings]}
                for port in ports
            ],
        },
    }


def pod_monitors(k8s: KubernetesConfig) -> list[dict]:
    """The head's and the workers' PodMonitor; empty when monitoring is off."""
    if not k8s.monitoring.enabled:
        return []
    cluster = _relabel("ray.io/cluster", "ray_io_cluster")
    return [
        _pod_monitor(k8s, f"{k8s.name}-ray-head", "head", ["serve", "metrics", "as-metrics", "dash-metrics"],
                     [cluster]),
        _pod_monitor(k8s, f"{k8s.name}-ray-workers", "worker", ["metrics"],
                     [cluster, _relabel("ray.io/group", "ray_group")]),
    ]
