"""Tandem's alerts: a PrometheusRule (prometheus-operator) for the rendered deployment.

| alert | fires when (for) |
|---|---|
| TandemQueueGrowing | a group has requests waiting and the queue grew over the last 10 minutes (10m) |
| TandemKVCacheFull | a replica's KV cache is more than 95% held (5m): preemptions and queueing follow |
| TandemHighErrorRatio | more than ``monitoring.error_ratio`` of HTTP responses are 5xx (5m) |
| TandemSlowFirstToken | a group's TTFT p99 is above ``monitoring.ttft_p99_seconds`` (10m) |
| TandemReplicaUnhealthy | Serve reports a replica unhealthy (5m) |
| TandemPodRestarts | a Ray container of this deployment restarted more than twice in 30 minutes (kube-state-metrics) |

Engine series come from the metric catalog (their names cannot drift from what replicas
export); Ray Serve's from ``dashboard_check.SERVE_METRICS``. ``promtool check rules`` and
``promtool test rules`` run on these groups in the tests.
"""

from __future__ import annotations

from cluster.config_k8s import KubernetesConfig
from cluster.k8s.pods import labels
from cluster.metrics.catalog import METRICS

_SERIES = {m.name: m.prometheus_name for m in METRICS}


def rule_groups(k8s: KubernetesConfig) -> list[dict]:
    """The rule groups, as Prometheus' rule files and the PrometheusRule's spec hold them."""
    waiting, kv = _SERIES["num_requests_waiting"], _SERIES["kv_cache_usage_perc"]
    ttft = _SERIES["time_to_first_token_seconds"]
    queue = f"sum by (application, group) ({waiting})"
    monitoring = k8s.monitoring

    def alert(name: str, expr: str, duration: str, severity: str, summary: str) -> dict:
        return {"alert": name, "expr": expr, "for": duration, "labels": {"severity": severity},
                "annotations": {"summary": summary}}

    rules = [
        alert("TandemQueueGrowing", f"{queue} > 0 and delta({queue}[10m:1m]) > 0", "10m", "warning",
              "Requests keep queueing in group {{ $labels.group }}: add replicas or raise autoscaling's bounds"),
        alert("TandemKVCacheFull", f"max by (application, group, replica) ({kv}) > 0.95", "5m", "warning",
              "KV cache of {{ $labels.replica }} above 95%: requests will be preempted and queue"),
        alert("TandemHighErrorRatio",
              'sum by (application) (rate(ray_serve_num_http_error_requests_total{error_code=~"5.."}[5m]))'
              " / sum by (application) (rate(ray_serve_num_http_requests_total[5m]))"
              f" > {monitoring.error_ratio}", "5m", "critical",
              f"More than {monitoring.error_ratio:.0%} of responses are server errors"),
        alert("TandemSlowFirstToken",
              f"histogram_quantile(0.99, sum by (application, group, le) (rate({ttft}_bucket[5m])))"
              f" > {monitoring.ttft_p99_seconds}", "10m", "warning",
              f"TTFT p99 of group {{{{ $labels.group }}}} above {monitoring.ttft_p99_seconds} s"),
        alert("TandemReplicaUnhealthy", "min by (application, deployment, replica) "
              "(ray_serve_deployment_replica_healthy) == 0", "5m", "critical",
              "Serve replica {{ $labels.replica }} of {{ $labels.deployment }} is unhealthy"),
        alert("TandemPodRestarts",
              f'increase(kube_pod_container_status_restarts_total{{namespace="{k8s.namespace}", '
              f'pod=~"{k8s.name}-.*"}}[30m]) > 2', "0m", "warning",
              "Container {{ $labels.container }} of pod {{ $labels.pod }} restarted more than twice in 30 minutes"),
    ]
    return [{"name": "tandem", "rules": rules}]


def prometheus_rule(k8s: KubernetesConfig) -> dict | None:
    """The PrometheusRule, labelled so that a Prometheus selecting the PodMonitors' labels loads it."""
    if not (k8s.monitoring.enabled and k8s.monitoring.alerts):
        return None
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": f"{k8s.name}-alerts", "namespace": k8s.namespace,
                         "labels": labels(k8s, "alerts") | k8s.monitoring.labels},
            "spec": {"groups": rule_groups(k8s)}}
