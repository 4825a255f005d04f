"""One Serve replica: an ``AsyncEngine`` (target + draft + controller) of one replica group.

Streams ``GenerateDelta``s: first an acknowledgement (or an error, when the engine
rejects the request), then the tokens. When the caller goes away, Ray Serve cancels
the stream, which aborts the request in the engine and frees its blocks before the
next step. Publishes ``ReplicaStats`` for the router through ``record_routing_stats``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import AsyncIterator

import torch
from ray import serve

from cluster.config import TandemConfig, config_from_dict, group_engine_config, with_overrides
from cluster.engine.async_engine import AsyncEngine, EngineDeadError
from cluster.engine.engine import Engine
from cluster.engine.outputs import RequestOutput
from cluster.engine.protocol import ErrorInfo, GenerateDelta, GenerateRequest, QueueFullError
from cluster.metrics.collector import EngineMetricsCollector
from cluster.parallel.executor import TensorParallelError
from cluster.routing.policy import peak_tokens_per_second
from cluster.routing.stats import ReplicaStats
from deployments.metrics import RaySink

logger = logging.getLogger(__name__)


class TandemReplica:
    def __init__(self, config: dict, group_name: str) -> None:
        full = config_from_dict(config, "replica config")
        self.config: TandemConfig = group_engine_config(full, group_name)
        self.group = self.config.serve.groups[0]
        if self.config.device.num_threads is None and self.group.num_gpus == 0:
            # A CPU replica computes with as many threads as Ray reserved CPUs for it.
            self.config = with_overrides(self.config, num_threads=max(1, int(self.group.num_cpus)))
        self.prefix_depth = full.serve.prefix_affinity_blocks
        self.engine = AsyncEngine(_build_engine(self.config, self.group),
                                  step_time_scale=self.group.step_time_scale)
        tags = {"group": self.group.name, "device_kind": self.group.device_kind}
        self.engine.metrics = EngineMetricsCollector(self.engine.engine, RaySink("replica", tags),
                                                     capacity=self.capacity_tokens_per_second)
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # constructed outside Serve (unit tests)
            self.replica_id = f"{group_name}-local"
        self._failed: str | None = None
        logger.info("replica %s of group %s ready (%s, %d torch threads)", self.replica_id, group_name,
                    self.config.model.model, torch.get_num_threads())

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        params = request.sampling_params
        if request.max_tokens_is_default:
            room = self.engine.engine.max_model_len - len(request.prompt_token_ids)
            params = dataclasses.replace(params, max_tokens=max(1, room), min_tokens=min(params.min_tokens, max(1, room)))
        try:
            stream = self.engine.generate(request.prompt_token_ids, params, request.request_id, request.cache_salt)
            first = await _first_or_error(stream)
        except QueueFullError as err:
            yield GenerateDelta(error=ErrorInfo(429, str(err), "rate_limit_error"))
            return
        except ValueError as err:
            yield GenerateDelta(error=ErrorInfo(400, str(err), param=_guess_param(str(err))))
            return
        except EngineDeadError as err:  # the engine failed before this request's first token
            self._failed = str(err)
            yield GenerateDelta(error=ErrorInfo(500, f"the engine failed: {err}", "server_error"))
            return
        yield GenerateDelta(accepted=True, num_prompt_tokens=len(request.prompt_token_ids),
                            replica_stats=self.record_routing_stats())
        try:
            if first is not None:
                yield _delta(first)
                if first.finished:
                    return
                async for out in stream:
                    yield _delta(out)
        except EngineDeadError as err:
            self._failed = str(err)
            yield GenerateDelta(error=ErrorInfo(500, f"the engine failed: {err}", "server_error"))
        finally:
            await stream.aclose()

    def record_routing_stats(self) -> dict:
        engine = self.engine.engine
        spec = engine.spec_stats
        current_k = spec.current_k
        max_num_seqs = self.config.scheduler.max_num_seqs
        stats = ReplicaStats(
            replica_id=self.replica_id,
            group=self.group.name,
            device_kind=self.group.device_kind,
            timestamp=time.time(),
            num_running=engine.scheduler.num_running,
            num_waiting=self.engine.num_waiting,
            max_num_seqs=max_num_seqs,
            kv_cache_usage=engine.block_manager.usage,
            current_k=current_k,
            acceptance=spec.acceptance_rate,
            step_time_curve=self.engine.step_times.curve(current_k, max_num_seqs),
            prefill_seconds_per_token=self.engine.step_times.prefill_seconds_per_token,
            speed_factor=self.engine.step_times.speed_factor,
            cached_prefix_hashes=engine.block_manager.cached_prefix_hashes(self.prefix_depth),
            block_size=engine.block_manager.block_size,
        )
        return stats.to_dict()

    def capacity_tokens_per_second(self) -> float:
        """Predicted peak output tokens/s at the current k and acceptance (0 before any
        profile or measured step)."""
        spec = self.engine.engine.spec_stats
        k = spec.current_k
        curve = self.engine.step_times.curve(k, self.config.scheduler.max_num_seqs)
        return peak_tokens_per_second(curve, spec.acceptance_rate, k)

    def engine_stats(self) -> dict:
        """Debug view: the engine's counters and free blocks, after checking its invariants."""
        engine = self.engine.engine
        engine.check_invariants()
        stats = engine.stats()
        pool = engine.block_manager.pool
        return {
            "replica_id": self.replica_id,
            "group": self.group.name,
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "kv_cache_usage": stats.kv_cache_usage,
            "num_blocks": pool.num_blocks,
            "num_free_blocks": pool.num_free_blocks,
            "num_preemptions": stats.num_preemptions,
            "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
        }

    def check_health(self) -> None:
        executor = getattr(self.engine.engine.worker.runner, "executor", None)
        if self._failed is None and executor is not None:
            try:
                executor.check_alive()  # a dead tensor-parallel rank: unhealthy before any request fails
            except TensorParallelError as err:
                self._failed = str(err)
        if self._failed is not None:
            raise RuntimeError(f"replica {self.replica_id} is unhealthy: {self._failed}")

    async def __del__(self) -> None:
        # Serve has already waited graceful_shutdown_timeout_s for in-flight requests.
        engine = getattr(self, "engine", None)  # absent when __init__ failed
        if engine is not None:
            await engine.shutdown()
            engine.engine.worker.close()


def _build_engine(config: TandemConfig, group) -> Engine:
    """The replica's engine; a group with ``tensor_parallel_size`` > 1 splits the target over
    this replica (rank 0) and one Ray actor per further rank in its placement group."""
    if group.tensor_parallel_size == 1:
        return Engine(config)
    from cluster.parallel.executor import start_tensor_parallel
    from deployments.tp_ranks import RayLauncher

    config = with_overrides(config, tensor_parallel_size=group.tensor_parallel_size)
    return Engine(config, start_tensor_parallel(config, RayLauncher(group.num_cpus, group.num_gpus)))


async def _first_or_error(stream: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    """Start the stream so validation errors surface here, before the acknowledgement."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


def _delta(out: RequestOutput) -> GenerateDelta:
    completion = out.outputs[0]
    return GenerateDelta(
        text=completion.delta_text,
        token_ids=list(completion.delta_token_ids),
        logprobs=completion.delta_logprobs,
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
        num_prompt_tokens=out.usage.prompt_tokens,
        num_output_tokens=out.usage.completion_tokens,
        num_cached_tokens=out.usage.cached_tokens,
    )


def _guess_param(message: str) -> str | None:
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "logprobs", "min_tokens", "stop_token_ids",
                 "stop", "seed", "cache_salt"):
        if message.startswith(name):
            return name
    if "prompt" in message:
        return "prompt"
    return None
