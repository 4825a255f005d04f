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
its blocks) within ``SHUTDOWN_TIMEOUT_S``, then Ray, and the process exits. The handlers are in
place from the start: a signal while the server starts stops it the same way. Should a step
hang (the raylet or the GCS gone), a watchdog exits the process once the bounds have passed; a
second signal exits at once.

Several servers run side by side on one host, each with its own Ray, on their own
``serve.port``; Ray's metrics port and Serve's proxy port, when the config leaves them at their
defaults, move to free ports if another server holds them (the command says which).
"""

from __future__ import annotations

import contextlib
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

SHUTDOWN_TIMEOUT_S = 30.0  # serve.shutdown itself; it overran 10 s on a loaded 2-core machine
RAY_SHUTDOWN_TIMEOUT_S = 20.0  # ray.shutdown, and what drain's calls may overrun their own bound by
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


def free_or_chosen_port(host: str, port: int, key: str, explicit: bool) -> int:
    """``port`` when it binds; when it does not, a free one if the config left ``key`` at its
    default (another server on this host has it), else a RuntimeError naming ``key``."""
    if binds(host, port):
        return port
    if explicit:
        raise RuntimeError(f"port {port} ({key}) is in use by another process on {host}: give each server on "
                           f"this host its own {key}")
    with socket.socket() as sock:
        sock.bind((host if host not in ("", "0.0.0.0", "::") else "127.0.0.1", 0))
        chosen = sock.getsockname()[1]
    print(f"{key}: port {port} is taken (another server on this host?), using {chosen}", flush=True)
    return chosen


class StopRequested(Exception):
    """SIGINT or SIGTERM arrived while the server was starting."""


class Stopper:
    """SIGINT and SIGTERM from the first moment of ``tandem serve``: the first signal asks for a
    drained stop (while starting, it interrupts the start-up, which then stops the same way); a
    second exits at once. ``install`` again after ``ray.init``, which installs a handler of its own."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.starting = True

    def install(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._handle)

    def _handle(self, signum, _frame) -> None:
        if self.requested.is_set():
            print("second signal: exiting now", flush=True)
            os._exit(128 + signum)
        self.requested.set()
        if self.starting:
            self.starting = False
            raise StopRequested()


def start_local(config: TandemConfig, app_name: str = "tandem", blocking: bool = True) -> str:
    """Deploy ``config`` and return the base URL; with ``blocking`` serve until SIGINT or SIGTERM
    (which also stop it, drained, while it starts)."""
    app = build_app(config)  # validate before starting anything
    host, port = config.serve.host, config.serve.port
    stopper = Stopper()
    if blocking:
        stopper.install()
    try:
        metrics_port, proxy_port = config.serve.metrics_export_port, port  # Serve's proxy on a running Ray
        if not ray.is_initialized():
            metrics_port, proxy_port = _start_ray(config)
        if blocking:
            stopper.install()  # ray.init replaced the handlers with its own (an exit without a drain)
        # A hub left draining by an earlier `tandem serve` on this Ray cluster would drain the new ingress.
        ray.get(application_hub(app_name).drain.remote(False), timeout=30)
        serve.start(http_options={"host": host, "port": proxy_port})
        serve.run(app, name=app_name, route_prefix="/", blocking=False, logging_config=config.serve.logging_config())
        url = f"http://{host}:{port}"
        _wait_for_http(url)
        stopper.starting = False
    except BaseException:
        if not stopper.requested.is_set():
            raise
        # StopRequested, or what Ray's code made of it where the signal interrupted it
        print("stop asked for while starting", flush=True)
        stop_bounded(app_name, config.serve.drain_timeout_s)
        return f"http://{host}:{port}"
    if blocking:
        print(f"Tandem serves {config.serve.served_model_name or config.model.model} at {url}/v1 "
              f"(OpenAI API), its metrics at {url}/metrics (Ray's at http://{host}:{metrics_port}/metrics); "
              "Ctrl-C or SIGTERM stops it", flush=True)
        while not stopper.requested.wait(0.5):  # a timed wait lets the handler run promptly
            pass
        stop_bounded(app_name, config.serve.drain_timeout_s)
    return url


def _start_ray(config: TandemConfig) -> tuple[int, int]:
    """Start this server's own Ray; returns the ports of Ray's metrics and of Serve's proxy (on
    ``serve.port`` itself, or beside the direct ingress on ``serve.proxy_port``, default
    ``serve.port`` + 1). Ports the config leaves at their defaults move aside when another server
    on this host holds them."""
    serve_config = config.serve
    environment = direct_ingress_environment(config)
    os.environ.update(environment)  # inherited by Ray's processes
    os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", CONTROL_LOOP_INTERVAL_S)
    proxy_port = serve_config.port
    if environment:
        wait_for_free_port(serve_config.host, serve_config.port)
        proxy_port = serve_config.proxy_port or free_or_chosen_port(
            serve_config.host, serve_config.port + 1, "serve.proxy_port", explicit=False)
    metrics_port = free_or_chosen_port("127.0.0.1", serve_config.metrics_export_port, "serve.metrics_export_port",
                                       "metrics_export_port" in serve_config.model_fields_set)
    # Logical CPUs: replicas of a CPU demo may share physical cores.
    num_cpus = max(os.cpu_count() or 1, int(logical_cpus_needed(config) + 0.999))
    ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING,
             _metrics_export_port=metrics_port)
    return metrics_port, proxy_port


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


def stop_bounded(app_name: str, drain_timeout_s: float) -> None:
    """Drain, then stop Serve and Ray. Every phase is bounded on its own: should one hang (the
    raylet, the GCS or the hub gone), the process exits anyway, the drain after ``drain_timeout_s``
    plus ``RAY_SHUTDOWN_TIMEOUT_S`` (its calls' overrun), the shutdown after ``SHUTDOWN_TIMEOUT_S``
    plus ``RAY_SHUTDOWN_TIMEOUT_S``; a drain that used its whole time leaves the shutdown all of its own."""
    if not ray.is_initialized():  # stopped before Ray was up: whatever ray.init left behind goes
        with _exit_after(SHUTDOWN_TIMEOUT_S + RAY_SHUTDOWN_TIMEOUT_S, "stopping"):
            ray.shutdown()
        return
    with _exit_after(max(drain_timeout_s, 0) + RAY_SHUTDOWN_TIMEOUT_S, "draining"):
        drain(app_name, drain_timeout_s)
    with _exit_after(SHUTDOWN_TIMEOUT_S + RAY_SHUTDOWN_TIMEOUT_S, "stopping"):
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
        try:
            ray.shutdown()
        except Exception:  # the process is leaving either way: say so, and exit as stopped
            logger.exception("ray.shutdown failed")


@contextlib.contextmanager
def _exit_after(bound_s: float, phase: str):
    """Exit the process with status 1 should the block take more than ``bound_s``."""
    def give_up() -> None:
        print(f"{phase} took more than {bound_s:.0f} s (is Ray's raylet or GCS gone?): exiting", flush=True)
        os._exit(1)

    watchdog = threading.Timer(bound_s, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()


def drain(app_name: str, timeout_s: float) -> None:
    """Tell the application's ingresses to turn new calls away and wait, at most ``timeout_s``,
    until every one of them has and none has a call in flight. A hub slow to answer (a loaded
    machine) is asked again until the bound; only a hub or Ray gone ends the drain early."""
    if timeout_s <= 0:
        return
    print(f"draining: new requests get a 503, those in flight have up to {timeout_s:g} s to finish", flush=True)
    start = time.monotonic()
    deadline = start + timeout_s
    in_flight, told_drain, slow_answers = 0, False, 0
    hub = None

    def wait_s() -> float:  # one call's bound: 10 s, and never past the drain's own
        return min(10.0, max(deadline - time.monotonic(), 0.1))

    while time.monotonic() < deadline:
        try:
            if hub is None:
                hub = application_hub(app_name)
            if not told_drain:
                ray.get(hub.drain.remote(), timeout=wait_s())
                told_drain = True
            ingresses, draining, in_flight = ray.get(hub.drain_status.remote(), timeout=wait_s())
        except ray.exceptions.GetTimeoutError:
            slow_answers += 1
            continue
        except Exception as err:  # Ray or the hub going away under us: stop as without a drain
            print(f"draining stopped early ({type(err).__name__}: {err})", flush=True)
            return
        if ingresses and draining == ingresses and in_flight == 0:
            print("drained: no request in flight", flush=True)
            return
        if not ingresses and time.monotonic() > start + 3 * REPORT_INTERVAL_S:
            print("no ingress reports to the hub: stopping without a drain", flush=True)
            return
        time.sleep(0.25)
    told = f" (the hub was slow to answer {slow_answers} time(s))" if slow_answers else ""
    print(f"{in_flight} request(s) still in flight after {timeout_s:g} s{told}", flush=True)
