"""PodDisruptionBudgets: voluntary evictions (node drains, node pool upgrades, the cluster
autoscaler) take at most one pod of a worker group at a time.

A worker pod holds whole replicas (``plan.py``), so evicting one costs those replicas and
their in-flight requests; with the budget, the rest of the group keeps serving while the
evicted pod's replicas come back elsewhere. The budget selects the group's pods by the
labels the worker template sets, so it also covers the pods of a second Ray cluster that an
upgrade brings up beside the first.
"""

from __future__ import annotations

from cluster.config import TandemConfig
from cluster.k8s.pods import labels
from cluster.k8s.plan import WorkerGroupPlan


def disruption_budgets(config: TandemConfig, plans: list[WorkerGroupPlan]) -> list[dict]:
    k8s = config.kubernetes
    if not k8s.pod_disruption_budget:
        return []
    return [{
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": f"{k8s.name}-{plan.name}", "namespace": k8s.namespace,
                     "labels": labels(k8s, "ray-worker") | {"tandem/group": plan.name}},
        "spec": {"maxUnavailable": 1,
                 "selector": {"matchLabels": labels(k8s, "ray-worker") | {"tandem/group": plan.name}}},
    } for plan in plans]
