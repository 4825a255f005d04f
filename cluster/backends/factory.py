"""The engine a replica group names: Tandem's (its engine core in a process of its own, or in a
thread of the replica's for tensor-parallel groups and ``engine.core_process: false``) or vLLM's."""

from __future__ import annotations

from cluster.backends.vllm import VllmBackend
from cluster.config import TandemConfig
from cluster.config_serve import ReplicaGroupConfig
from cluster.hosting.backend import BackendContext, EngineBackend
from cluster.hosting.inproc_client import InprocClient
from cluster.hosting.process_client import ProcessClient


def build_backend(config: TandemConfig, group: ReplicaGroupConfig, context: BackendContext) -> EngineBackend:
    """The backend ``config.engine.backend`` names, built from one group's engine settings
    (``group_engine_config``); vLLM is imported only when a group asks for it."""
    backend = config.engine.backend
    if backend == "native" and config.engine.core_process and group.tensor_parallel_size == 1:
        return ProcessClient(config, group, context)
    if backend == "native":
        return InprocClient.for_group(config, group, context)
    if backend == "vllm":
        return VllmBackend(config, group, context)
    raise ValueError(f"unknown engine backend {backend!r}; choose native or vllm")
