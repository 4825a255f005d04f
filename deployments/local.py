"""``tandem serve``: run the application on a local Ray (started if none is running)."""

from __future__ import annotations

import logging
import os
import signal
import threading

import ray
from ray import serve

from cluster.config import TandemConfig
from deployments.app import build_app

logger = logging.getLogger(__name__)


def logical_cpus_needed(config: TandemConfig) -> float:
    groups = config.serve.groups
    replicas = sum((g.autoscaling.max_replicas if g.autoscaling else g.num_replicas) * g.tensor_parallel_size
                   * g.num_cpus for g in groups)
    return replicas + config.serve.ingress_num_cpus + 1


def start_local(config: TandemConfig, app_name: str = "tandem", blocking: bool = True) -> str:
    """Deploy ``config`` and return the base URL; with ``blocking`` serve until interrupted."""
    app = build_app(config)  # validate before starting anything
    if not ray.is_initialized():
        # Logical CPUs: replicas of a CPU demo may share physical cores.
        num_cpus = max(os.cpu_count() or 1, int(logical_cpus_needed(config) + 0.999))
        ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING,
                 _metrics_export_port=config.serve.metrics_export_port)
    host, port = config.serve.host, config.serve.port
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name=app_name, route_prefix="/", blocking=False)
    url = f"http://{host}:{port}"
    if blocking:
        print(f"Tandem serves {config.serve.served_model_name or config.model.model} at {url}/v1 "
              f"(OpenAI API), Prometheus metrics at http://{host}:{config.serve.metrics_export_port}/metrics; "
              "Ctrl-C stops it", flush=True)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
        finally:
            serve.shutdown()
    return url
