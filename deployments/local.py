"""``tandem serve``: run the application on a local Ray (started if none is running).

When this call starts Ray and ``serve.direct_ingress`` is on (the default), Ray Serve runs
in its throughput-optimized mode with direct ingress: the ingress replica itself answers
HTTP on ``serve.port``, so a streamed token crosses one Ray hop (engine replica to
ingress) instead of two (and the ingress reaches the replicas over gRPC). Serve's HTTP
proxy still runs, on ``serve.proxy_port``. The mode is read from the environment of
Ray's processes, so it can only be chosen by whoever starts Ray; against a running Ray,
Serve's proxy answers on ``serve.port`` as before.

When this call starts Ray it also runs Serve's controller loop every ``CONTROL_LOOP_INTERVAL_S``
instead of every 0.1 s (unless the environment names an interval): on a machine whose cores the
engine computes on, every per cent Ray's idle loops take is the engine's.

The ingress stays on ``serve.port`` when it is replaced (its process died) or the server starts
again at once: it binds with ``SO_REUSEADDR`` (``deployments/ingress_port.py``), and Serve gives a
released port back at once instead of holding it 150 s for a load balancer's stale routes
(there is none in front here). Before starting Ray this call fails at once when another
process listens on the port, and waits while connections of a listener that did not allow
reuse (a server of an older Tandem, another program) still hold it.

SIGTERM and SIGINT stop the server alike, draining it first: the ingress turns new API calls
away with a 503 (and ``/health`` says ``draining``) while the calls in flight finish, for at
most ``serve.drain_timeout_s``; then Serve is shut down (what is left is aborted, which frees
its blocks) within ``SHUTDOWN_TIMEOUT_S``, then Ray, and the process exits.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import urllib.request

import ray
from ray import serve

from cluster.config import ConfigError, TandemConfig
from deployments.app import build_app
from deployments.app_hub import REPORT_INTERVAL_S, application_hub
from deployments.ingress_port import binds

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 10.0
READY_TIMEOUT_S = 120.0
PORT_FREE_TIMEOUT_S = 75.0  # Linux holds an actively closed connection in TIME_WAIT for 60 s
# Measured on 2 cores: Serve's controller took 3.3-3.5% of the 200% at 0.1 s and 1.1% at 1 s, idle
# and at 2 requests/s alike; Serve then reconciles (deploys, replaces replicas) once a second.
CONTROL_LOOP_INTERVAL_S = "1"


def logical_cpus_needed(config: TandemConfig) -> float:
    groups = config.serve.groups
    replicas = sum((g.autoscaling.max_replicas if g.autoscaling else g.num_replicas) * g.tensor_parallel_size
                   * g.num_cpus for g in groups)
    return replicas + config.serve.ingress_num_cpus + 1


def direct_ingress_environment(config: TandemConfig) -> dict[str, str]:
    """The variables that put Ray Serve in throughput-optimized mode with the ingress replica
    listening on ``serve.port`` (empty when ``serve.direct_ingress`` is off)."""
    serve_config = config.serve
    if not serve_config.direct_ingress or serve_config.port == 0:
        return {}
    if (serve_config.ingress_num_replicas or 1) > 1 or serve_config.ingress_autoscaling is not None:
        raise ConfigError("serve.direct_ingress answers on serve.port from one ingress replica; for several "
                          "(serve.ingress_num_replicas, ingress_autoscaling) set serve.direct_ingress: false, "
                          "so that Serve's proxy spreads requests over them")
    return {
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(serve_config.port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(serve_config.port + 100),
        # No load balancer in front to deregister from: a stopping replica need not wait 30 s, and a
        # replaced ingress may take its predecessor's port (serve.port) at once.
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
    }


def _listening(host: str, port: int) -> bool:
    target = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    try:
        with socket.create_connection((target, port), timeout=2):
            return True
    except OSError:
        return False


def wait_for_free_port(host: str, port: int, timeout_s: float = PORT_FREE_TIMEOUT_S) -> None:
    """Return once ``port`` binds as the ingress binds it (``ingress_port.binds``). A port that
    another process listens on raises at once; one held only by closing connections of a
    listener that did not allow reuse is waited for, up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    told = False
    while not binds(host, port):
        if _listening(host, port):
            raise RuntimeError(f"port {port} (serve.port) is in use by another process on {host}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"port {port} (serve.port) still holds a stopped server's connections after "
                               f"{timeout_s:.0f} s (TIME_WAIT); choose another serve.port or try again")
        if not told:
            print(f"waiting for port {port}: a stopped server's connections are closing (TIME_WAIT, up to a "
                  "minute)", flush=True)
            told = True
        time.sleep(1.0)


def start_local(config: TandemConfig, app_name: str = "tandem", blocking: bool = True) -> str:
    """Deploy ``config`` and return the base URL; with ``blocking`` serve until SIGINT or SIGTERM."""
    app = build_app(config)  # validate before starting anything
    host, port = config.serve.host, config.serve.port
    proxy_port = port
    if not ray.is_initialized():
        environment = direct_ingress_environment(config)
        os.environ.update(environment)  # inherited by Ray's processes
        os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", CONTROL_LOOP_INTERVAL_S)
        if environment:
            proxy_port = config.serve.proxy_port or port + 1
            wait_for_free_port(host, port)
        # Logical CPUs: replicas of a CPU demo may share physical cores.
        num_cpus = max(os.cpu_count() or 1, int(logical_cpus_needed(config) + 0.999))
        ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING,
                 _metrics_export_port=config.serve.metrics_export_port)
    # A hub left draining by an earlier `tandem serve` on this Ray cluster would drain the new ingress.
    ray.get(application_hub(app_name).drain.remote(False), timeout=30)
    serve.start(http_options={"host": host, "port": proxy_port})
    serve.run(app, name=app_name, route_prefix="/", blocking=False, logging_config=config.serve.logging_config())
    url = f"http://{host}:{port}"
    _wait_for_http(url)
    if blocking:
        print(f"Tandem serves {config.serve.served_model_name or config.model.model} at {url}/v1 "
              f"(OpenAI API), its metrics at {url}/metrics (Ray's at "
              f"http://{host}:{config.serve.metrics_export_port}/metrics); "
              "Ctrl-C or SIGTERM stops it", flush=True)
        serve_until_signalled(app_name, config.serve.drain_timeout_s)
    return url


def _wait_for_http(url: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the application is running but nothing answers at {url}/health")
        time.sleep(0.5)


def serve_until_signalled(app_name: str, drain_timeout_s: float) -> None:
    """Block until SIGINT or SIGTERM, drain, then stop Serve and Ray within a bounded time."""
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda received, _frame: stop.set())
    while not stop.wait(0.5):  # a timed wait lets the handler run promptly
        pass
    drain(app_name, drain_timeout_s)
    print("stopping: shutting Serve down (requests still in flight are aborted)", flush=True)
    done = threading.Event()

    def shut_down() -> None:
        try:
            serve.shutdown()
        except Exception:  # Ray may already be going away
            logger.exception("serve.shutdown failed")
        done.set()

    threading.Thread(target=shut_down, name="tandem-shutdown", daemon=True).start()
    if not done.wait(SHUTDOWN_TIMEOUT_S):
        print(f"Serve did not stop within {SHUTDOWN_TIMEOUT_S:.0f} s; stopping Ray", flush=True)
    ray.shutdown()


def drain(app_name: str, timeout_s: float) -> None:
    """Tell the application's ingresses to turn new calls away and wait, at most ``timeout_s``,
    until every one of them has and none has a call in flight."""
    if timeout_s <= 0:
        return
    print(f"draining: new requests get a 503, those in flight have up to {timeout_s:g} s to finish", flush=True)
    start = time.monotonic()
    in_flight = 0
    try:
        hub = application_hub(app_name)
        ray.get(hub.drain.remote(), timeout=10)
        while time.monotonic() < start + timeout_s:
            ingresses, draining, in_flight = ray.get(hub.drain_status.remote(), timeout=10)
            if ingresses and draining == ingresses and in_flight == 0:
                print("drained: no request in flight", flush=True)
                return
            if not ingresses and time.monotonic() > start + 3 * REPORT_INTERVAL_S:
                print("no ingress reports to the hub: stopping without a drain", flush=True)
                return
            time.sleep(0.25)
    except Exception as err:  # Ray going away under us: stop as without a drain
        print(f"draining stopped early ({type(err).__name__}: {err})", flush=True)
        return
    print(f"{in_flight} request(s) still in flight after {timeout_s:g} s", flush=True)
