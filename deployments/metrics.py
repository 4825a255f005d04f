"""Where the processes' metrics meet: a Ray actor per Serve application that keeps the latest
Prometheus text of every engine replica and ingress, pushed every ``PUSH_INTERVAL_S``, and
hands the fresh ones to the ingress that answers ``GET /metrics``.

A process whose pushes stop (it died, or was replaced) drops out after ``MAX_AGE_S``; a
process's counters live in the process, so the hub holds nothing a restart of it would lose.
The hub is detached and named after the application, so every replica and ingress of it
finds the same one, whichever started first.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import ray

logger = logging.getLogger(__name__)

PUSH_INTERVAL_S = 2.0
MAX_AGE_S = 30.0


@ray.remote(num_cpus=0, max_restarts=-1)
class MetricsHub:
    def __init__(self) -> None:
        self._latest: dict[str, tuple[float, dict[str, str], str]] = {}

    def put(self, source_id: str, labels: dict[str, str], text: str) -> None:
        self._latest[source_id] = (time.time(), labels, text)

    def fresh(self, max_age_s: float = MAX_AGE_S) -> list[tuple[dict[str, str], str]]:
        """(labels, text) of every source heard from within ``max_age_s``; older ones are forgotten."""
        now = time.time()
        for source_id in [k for k, (at, _, _) in self._latest.items() if now - at > max_age_s]:
            del self._latest[source_id]
        return [(labels, text) for _, labels, text in self._latest.values()]


def metrics_hub(app_name: str | None):
    """The application's hub, started by the first process that asks."""
    return MetricsHub.options(name=f"tandem-metrics-{app_name or 'default'}", namespace="tandem",
                              lifetime="detached", get_if_exists=True).remote()


class MetricsPusher:
    """Pushes ``render()`` (a process's Prometheus text) to the hub every ``interval_s`` from a
    daemon thread, under ``labels`` (its application, deployment and replica); a failed push is
    logged once and retried with a fresh handle at the next tick."""

    def __init__(self, app_name: str | None, labels: dict[str, str], render: Callable[[], str],
                 interval_s: float = PUSH_INTERVAL_S) -> None:
        self.app_name, self.labels, self.render, self.interval_s = app_name, labels, render, interval_s
        self._stop = threading.Event()
        self._hub = None
        self._warned = False
        threading.Thread(target=self._run, name="tandem-metrics-push", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.push()

    def push(self) -> None:
        try:
            if self._hub is None:
                self._hub = metrics_hub(self.app_name)
            self._hub.put.remote(self.labels["replica"], self.labels, self.render())
            self._warned = False
        except Exception as err:  # the hub restarting, the cluster shutting down: try again next time
            self._hub = None
            if not self._warned:
                logger.warning("metrics push to the hub failed (%s: %s); retrying", type(err).__name__, err)
                self._warned = True

    def stop(self) -> None:
        self._stop.set()
