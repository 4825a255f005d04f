"""Merging the Prometheus text of several processes into the one page ``GET /metrics`` serves,
and reading a counter back from such a page.

Each engine replica and ingress renders its own registry (``prometheus_sink.py``); the page
puts every family once (one ``# HELP`` and ``# TYPE``) with the samples of all sources, each
sample given its source's labels (``catalog.SOURCE_LABELS``: application, deployment,
replica), so the replicas of one group never produce the same series twice.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def merge(sources: list[tuple[dict[str, str], str]]) -> str:
    """``sources``: (the labels to add to each of its samples, its text). Families of one name
    from several sources become one; a source's text that cannot be parsed is skipped."""
    families: dict[str, Metric] = {}
    for extra, text in sources:
        try:
            parsed = list(text_string_to_metric_families(text))
        except ValueError:
            continue
        for family in parsed:
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            merged.samples.extend(Sample(s.name, {**s.labels, **extra}, s.value, s.timestamp, s.exemplar)
                                  for s in family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry).decode()


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        return self.families


def sample_total(exposition: str, name: str) -> float | None:
    """The sum of the samples named ``name`` (e.g. ``vllm:num_preemptions_total``) over every label
    set of a ``/metrics`` page; None where the page has none."""
    values = [sample.value for family in text_string_to_metric_families(exposition)
              for sample in family.samples if sample.name == name]
    return float(sum(values)) if values else None
