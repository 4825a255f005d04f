"""A ``MetricsSink`` that keeps the catalog's metrics in a Prometheus registry of its own, under
their exposed names (``vllm:...``, ``tandem:...``), and renders it as Prometheus' text format.

Each recording process (an engine replica, an ingress) holds one; the series exist from the
start (counters at 0, histograms empty) for the labels every sample of the process carries
(``fixed_labels``: the model name, group and device kind of a replica). No Ray here.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from cluster.metrics.catalog import ALIASES, METRICS, METRICS_BY_NAME, MetricSpec
from cluster.metrics.collector import Labels
from cluster.spec_decode.suffix_stats import SuffixTreeStats

# Labelled series that every replica shows from the start, at 0, whatever its engine (native or vLLM).
KNOWN_LABEL_VALUES: dict[str, list[Labels]] = {
    "tandem_suffix_speculations": [(("match_len", r),) for r in SuffixTreeStats.match_len_ranges()],
}

# No ``_created`` series beside counters and histograms (as vLLM's server): they double what a
# scrape carries and no dashboard reads them. This is the process-wide switch prometheus_client has.
disable_created_metrics()


class PrometheusSink:
    def __init__(self, source: str, fixed_labels: dict[str, str] | None = None) -> None:
        """``source``: the catalog's "replica" or "ingress"; ``fixed_labels``: values for the
        labels the catalog gives every metric of that source (COMMON_LABELS for a replica)."""
        self.registry = CollectorRegistry(auto_describe=False)
        self.fixed = dict(fixed_labels or {})
        self._metrics = {}
        self._children = {}  # (name, labels) -> the labelled series: replayed samples hit it per token
        for spec in METRICS:
            if spec.source != source:
                continue
            missing = [k for k in spec.all_labels if k not in spec.labels and k not in self.fixed]
            if missing:
                raise ValueError(f"{spec.name} needs values for the labels {missing}")
            metric = _make(spec, self.registry)
            self._metrics[spec.name] = metric
            if not spec.labels:  # the series shows from the start
                self._child(spec.name, ())
            for labels in KNOWN_LABEL_VALUES.get(spec.name, ()):  # so do those whose label values are known
                self._child(spec.name, labels)

    def inc(self, name: str, value: float, labels: Labels = ()) -> None:
        self._child(name, labels).inc(value)

    def set(self, name: str, value: float, labels: Labels = ()) -> None:
        if METRICS_BY_NAME[name].latest_only:
            self._metrics[name].clear()
        for target in (name, ALIASES.get(name)):
            if target is not None:
                self._child(target, labels).set(value)

    def observe(self, name: str, value: float, labels: Labels = ()) -> None:
        for target in (name, ALIASES.get(name)):
            if target is not None:
                self._child(target, labels).observe(max(0.0, value))

    def exposition(self) -> str:
        """The registry in Prometheus' text format (version 0.0.4)."""
        return generate_latest(self.registry).decode()

    def _child(self, name: str, labels: Labels):
        child = self._children.get((name, labels))
        if child is None:
            values = self.fixed | dict(labels)
            child = self._metrics[name].labels(**{k: values[k] for k in METRICS_BY_NAME[name].all_labels})
            if not METRICS_BY_NAME[name].latest_only:  # cleared on every set: never cached
                self._children[(name, labels)] = child
        return child


def _make(spec: MetricSpec, registry: CollectorRegistry):
    description = f"{spec.description} ({spec.unit})"
    labels = list(spec.all_labels)
    if spec.kind == "counter":  # prometheus_client adds the _total
        return Counter(spec.exposed_name, description, labels, registry=registry)
    if spec.kind == "gauge":
        return Gauge(spec.exposed_name, description, labels, registry=registry)
    return Histogram(spec.exposed_name, description, labels, buckets=list(spec.buckets), registry=registry)
