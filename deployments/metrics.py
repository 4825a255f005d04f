"""The metric catalog bound to Ray: ``ray.serve.metrics`` objects that Ray's Prometheus
endpoint (``metrics_export_port`` on every node) exposes with Serve's ``deployment``,
``replica`` and ``application`` labels. See ``cluster/metrics/catalog.py`` for the list."""

from __future__ import annotations

from ray.serve import metrics as serve_metrics

from cluster.metrics.catalog import METRICS, MetricSpec
from cluster.metrics.collector import Labels


class RaySink:
    """A ``MetricsSink`` writing to Ray; ``default_tags`` fills the common labels
    (a replica's group and device kind)."""

    def __init__(self, source: str, default_tags: dict[str, str] | None = None) -> None:
        self._metrics = {spec.name: _make(spec, default_tags or {}) for spec in METRICS if spec.source == source}

    def inc(self, name: str, value: float, labels: Labels = ()) -> None:
        if value == 0:
            # A counter is exported from 0, as Prometheus clients do; Ray's public inc()
            # refuses 0, so the point goes through the method inc() itself ends in.
            self._metrics[name]._record(0.0, tags=dict(labels))
            return
        self._metrics[name].inc(value, tags=dict(labels))

    def set(self, name: str, value: float, labels: Labels = ()) -> None:
        self._metrics[name].set(value, tags=dict(labels))

    def observe(self, name: str, value: float, labels: Labels = ()) -> None:
        self._metrics[name].observe(max(0.0, value), tags=dict(labels))


def _make(spec: MetricSpec, default_tags: dict[str, str]):
    description = f"{spec.description} ({spec.unit})"
    tag_keys = spec.all_labels
    if spec.kind == "counter":
        metric = serve_metrics.Counter(spec.name, description=description, tag_keys=tag_keys)
    elif spec.kind == "gauge":
        metric = serve_metrics.Gauge(spec.name, description=description, tag_keys=tag_keys)
    else:
        metric = serve_metrics.Histogram(spec.name, description=description, boundaries=list(spec.buckets),
                                         tag_keys=tag_keys)
    defaults = {k: v for k, v in default_tags.items() if k in tag_keys}
    if defaults:
        metric.set_default_tags(defaults)
    return metric
