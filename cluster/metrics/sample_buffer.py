"""Metric samples held in one process and written to a sink in another.

The engine-core process has no Ray, so its ``EngineMetricsCollector`` writes to a
``BufferedSink``; each step message carries the drained ``SampleBatch`` and the replica
replays it into its Ray sink. Counters are summed per series and gauges keep their
latest value, so a batch is small whatever the step's size; observations are kept
one by one (histograms need each).
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.metrics.collector import Labels, MetricsSink

Series = tuple[str, Labels]


@dataclass(frozen=True)
class SampleBatch:
    counters: dict[Series, float]
    gauges: dict[Series, float]
    observations: dict[Series, list[float]]

    def replay(self, sink: MetricsSink) -> None:
        for (name, labels), value in self.counters.items():
            sink.inc(name, value, labels)
        for (name, labels), value in self.gauges.items():
            sink.set(name, value, labels)
        for (name, labels), values in self.observations.items():
            for value in values:
                sink.observe(name, value, labels)


class BufferedSink:
    """A ``MetricsSink`` that keeps its samples until ``drain``."""

    def __init__(self) -> None:
        self._counters: dict[Series, float] = {}
        self._gauges: dict[Series, float] = {}
        self._observations: dict[Series, list[float]] = {}

    def inc(self, name: str, value: float, labels: Labels = ()) -> None:
        key = (name, labels)
        self._counters[key] = self._counters.get(key, 0.0) + value

    def set(self, name: str, value: float, labels: Labels = ()) -> None:
        self._gauges[(name, labels)] = value

    def observe(self, name: str, value: float, labels: Labels = ()) -> None:
        self._observations.setdefault((name, labels), []).append(value)

    def drain(self) -> SampleBatch | None:
        """The samples since the last drain (None when there are none)."""
        if not (self._counters or self._gauges or self._observations):
            return None
        batch = SampleBatch(self._counters, self._gauges, self._observations)
        self._counters, self._gauges, self._observations = {}, {}, {}
        return batch
