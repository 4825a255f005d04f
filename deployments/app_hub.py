"""What the processes of one Serve application share, through one Ray actor: each engine
replica's and ingress's latest metrics page (for ``GET /metrics``), each ingress's count of
API calls in flight, and whether the application is draining (``tandem serve`` on SIGTERM).

Every process reports every ``REPORT_INTERVAL_S`` from a daemon thread and learns from the
answer whether to drain. A process whose reports stop (it died, or was replaced) drops out
after ``MAX_AGE_S``; its counters live in the process, so the hub holds nothing a restart of
it would lose. The hub is detached and named after the application, so every process of it
finds the same one, whichever started first.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import ray

logger = logging.getLogger(__name__)

REPORT_INTERVAL_S = 2.0
MAX_AGE_S = 30.0


@dataclass(frozen=True)
class Report:
    labels: dict[str, str]  # application, deployment, replica: added to each of its series
    metrics: str  # its registry in Prometheus' text format
    in_flight: int | None  # an ingress's API calls in flight (None: not an ingress)
    draining: bool  # whether it already turns new calls away


@ray.remote(num_cpus=0, max_restarts=-1)
class ApplicationHub:
    def __init__(self) -> None:
        self._latest: dict[str, tuple[float, Report]] = {}
        self._draining = False

    def report(self, source_id: str, report: Report) -> bool:
        """Keep the source's latest report; answers whether the application is draining."""
        self._latest[source_id] = (time.time(), report)
        return self._draining

    def metrics(self) -> list[tuple[dict[str, str], str]]:
        """(labels, page) of every source heard from within MAX_AGE_S."""
        return [(r.labels, r.metrics) for r in self._fresh()]

    def drain(self, draining: bool = True) -> None:
        """Start draining (or, with False, serve again: a new deployment of the application)."""
        self._draining = draining

    def drain_status(self) -> tuple[int, int, int]:
        """(ingresses heard from, those of them that turn new calls away, API calls in flight)."""
        ingresses = [r for r in self._fresh() if r.in_flight is not None]
        return len(ingresses), sum(r.draining for r in ingresses), sum(r.in_flight for r in ingresses)

    def _fresh(self) -> list[Report]:
        now = time.time()
        for source_id in [k for k, (at, _) in self._latest.items() if now - at > MAX_AGE_S]:
            del self._latest[source_id]
        return [report for _, report in self._latest.values()]


def application_hub(app_name: str | None):
    """The application's hub, started by the first process that asks."""
    return ApplicationHub.options(name=f"tandem-hub-{app_name or 'default'}", namespace="tandem",
                                  lifetime="detached", get_if_exists=True).remote()


class HubReporter:
    """Reports a process to its application's hub every ``interval_s`` from a daemon thread:
    ``labels`` (its application, deployment and replica), ``metrics()`` (its page) and, for an
    ingress, ``in_flight()`` and ``draining()``; calls ``on_drain`` once the hub says to drain.
    A failed report is logged once and retried with a fresh handle at the next tick."""

    def __init__(self, app_name: str | None, labels: dict[str, str], metrics: Callable[[], str],
                 in_flight: Callable[[], int] | None = None, draining: Callable[[], bool] | None = None,
                 on_drain: Callable[[], None] | None = None, interval_s: float = REPORT_INTERVAL_S) -> None:
        self.app_name, self.labels, self.interval_s = app_name, labels, interval_s
        self._metrics, self._in_flight, self._draining, self._on_drain = metrics, in_flight, draining, on_drain
        self._stop = threading.Event()
        self._hub = None
        self._warned = False
        threading.Thread(target=self._run, name="tandem-hub-report", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.report()

    def report(self) -> None:
        try:
            if self._hub is None:
                self._hub = application_hub(self.app_name)
            report = Report(self.labels, self._metrics(), None if self._in_flight is None else self._in_flight(),
                            self._draining is not None and self._draining())
            drain = ray.get(self._hub.report.remote(self.labels["replica"], report), timeout=10)
            self._warned = False
        except Exception as err:  # the hub restarting, the cluster shutting down: try again next time
            self._hub = None
            if not self._warned:
                logger.warning("report to the application hub failed (%s: %s); retrying", type(err).__name__, err)
                self._warned = True
            return
        if drain and self._on_drain is not None:
            self._on_drain()

    def stop(self) -> None:
        self._stop.set()
