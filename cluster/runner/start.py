"""Starting the worker a config asks for: one process, or the driver of tensor-parallel ranks."""

from __future__ import annotations

from cluster.config import TandemConfig
from cluster.runner.tp_executor import start_tensor_parallel
from cluster.runner.worker import Worker


def start_worker(config: TandemConfig) -> Worker:
    """Load the model of ``config``; with ``parallel.tensor_parallel_size`` > 1 this starts
    the other ranks' processes and returns the driver rank's worker, whose ``close`` stops them."""
    if config.parallel.tensor_parallel_size > 1:
        return start_tensor_parallel(config)
    return Worker.from_config(config)
