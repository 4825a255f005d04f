"""Whether the application can serve: what ``GET /health`` answers.

The ingress starts listening before the engine replicas have loaded their models (with
direct ingress it is its own HTTP server), so a probe that only reached the ingress would
send traffic to a server that queues it for minutes. Health is read from Serve's own view
(``serve.status()``, the controller's, so it never queues behind requests): every replica
group that keeps replicas (``num_replicas``, or ``min_replicas`` above zero) needs one in
the ``RUNNING`` state. A group autoscaled to zero replicas does not count: a request starts
one. A replica whose engine died fails its health check and leaves ``RUNNING`` while Serve
replaces it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Mapping

from cluster.config_serve import replica_deployment_name

logger = logging.getLogger("ray.serve")


def unready_groups(status, app_name: str, required: list[str]) -> dict[str, str]:
    """Group name -> why it cannot serve, for each group of ``required`` with no running
    replica in ``status`` (a ``serve.status()`` result); empty when all can serve."""
    app = status.applications.get(app_name)
    if app is None:
        return {group: f"the application {app_name!r} is not deployed" for group in required}
    problems = {}
    for group in required:
        deployment = app.deployments.get(replica_deployment_name(group))
        if deployment is None:
            problems[group] = "its deployment does not exist yet"
        elif not _running(deployment.replica_states):
            states = ", ".join(f"{count} {_name(state)}" for state, count in deployment.replica_states.items())
            message = f": {deployment.message}" if deployment.message else ""
            problems[group] = (f"no replica is running (replicas: {states or 'none'}; "
                               f"deployment {_name(deployment.status)}{message})")
    return problems


def _running(replica_states: Mapping) -> int:
    return sum(count for state, count in replica_states.items() if _name(state) == "RUNNING")


def _name(state) -> str:
    """A Serve state enum's name (``ReplicaState.RUNNING`` -> ``RUNNING``), or the string itself."""
    return str(getattr(state, "value", state))


class GroupWatch:
    """Tells ``on_change`` which of ``required`` groups have no running replica, and when that view
    was read, from a daemon thread that reads ``status()`` (``serve.status``) every ``interval_s``:
    the ingress's router then leaves those groups out while another can serve (a node lost with
    its replicas)."""

    def __init__(self, status: Callable[[], object], app_name: str, required: list[str],
                 on_change: Callable[[set[str], float], None], interval_s: float = 1.0) -> None:
        self._status, self._app_name, self._required = status, app_name, required
        self._on_change, self._interval_s = on_change, interval_s
        self._stop = threading.Event()
        self.unavailable: set[str] = set()
        threading.Thread(target=self._run, name="tandem-group-watch", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.check()

    def check(self) -> None:
        read_at = time.time()
        try:
            unavailable = set(unready_groups(self._status(), self._app_name, self._required))
        except Exception as err:  # the controller busy or restarting: keep the last view
            logger.warning("reading Serve's status failed (%s: %s)", type(err).__name__, err)
            return
        if unavailable != self.unavailable:
            (logger.warning if unavailable else logger.info)("replica groups without a running replica: %s",
                                                             sorted(unavailable) or "none")
            self.unavailable = unavailable
            self._on_change(unavailable, read_at)

    def stop(self) -> None:
        self._stop.set()
