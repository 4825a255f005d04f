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

from typing import Mapping

from cluster.config_serve import replica_deployment_name


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
