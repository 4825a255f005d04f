"""Tandem's own engine behind ``EngineBackend``: an ``AsyncEngine`` (target + draft +
speculation controller) with its metrics collector.

A group with ``tensor_parallel_size`` > 1 splits the target over this process (rank 0)
and further ranks started by ``context.tp_launcher`` (Ray actors in a cluster) or, without
one, by local processes.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import AsyncIterator

from cluster.config import TandemConfig, with_overrides
from cluster.config_serve import ReplicaGroupConfig
from cluster.engine.async_engine import AsyncEngine, EngineDeadError
from cluster.engine.backend import BackendContext, EngineLoad, EngineUnhealthyError, SpecState, error_param
from cluster.engine.engine import Engine
from cluster.engine.outputs import RequestOutput
from cluster.engine.protocol import ErrorInfo, GenerateDelta, GenerateRequest, QueueFullError
from cluster.metrics.collector import EngineMetricsCollector
from cluster.parallel.executor import TensorParallelError
from cluster.routing.policy import peak_tokens_per_second
from cluster.spec.latency_model import power_of_two_sizes

logger = logging.getLogger(__name__)


class NativeBackend:
    name = "native"

    def __init__(self, config: TandemConfig, group: ReplicaGroupConfig, context: BackendContext) -> None:
        self.config = config
        self.engine = AsyncEngine(_build_engine(config, group, context), step_time_scale=group.step_time_scale)
        if context.metrics_sink is not None:
            self.engine.metrics = EngineMetricsCollector(self.engine.engine, context.metrics_sink,
                                                         capacity=self.capacity_tokens_per_second)
        self.max_model_len = self.engine.engine.max_model_len
        self._failed: str | None = None

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        params = request.sampling_params
        if request.max_tokens_is_default:
            room = self.max_model_len - len(request.prompt_token_ids)
            params = dataclasses.replace(params, max_tokens=max(1, room), min_tokens=min(params.min_tokens, max(1, room)))
        try:
            stream = self.engine.generate(request.prompt_token_ids, params, request.request_id, request.cache_salt)
            first = await _first_or_error(stream)
        except QueueFullError as err:
            yield GenerateDelta(error=ErrorInfo(429, str(err), "rate_limit_error"))
            return
        except ValueError as err:
            yield GenerateDelta(error=ErrorInfo(400, str(err), param=error_param(str(err))))
            return
        except EngineDeadError as err:  # the engine failed before this request's first token
            self._failed = str(err)
            yield GenerateDelta(error=ErrorInfo(500, f"the engine failed: {err}", "server_error"))
            return
        yield GenerateDelta(accepted=True, num_prompt_tokens=len(request.prompt_token_ids))
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

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def load(self, prefix_depth: int) -> EngineLoad:
        engine = self.engine.engine
        spec = engine.spec_stats
        k = spec.current_k
        max_num_seqs = self.config.scheduler.max_num_seqs
        times = self.engine.step_times
        return EngineLoad(
            num_running=engine.scheduler.num_running,
            num_waiting=self.engine.num_waiting,
            max_num_seqs=max_num_seqs,
            kv_cache_usage=engine.block_manager.usage,
            current_k=k,
            acceptance=spec.effective_acceptance_rate,
            step_time_curve=times.curve(k, max_num_seqs),
            prefill_seconds_per_token=times.prefill_seconds_per_token,
            speed_factor=times.speed_factor,
            cached_prefix_hashes=engine.block_manager.cached_prefix_hashes(prefix_depth),
            block_size=engine.block_manager.block_size,
        )

    def capacity_tokens_per_second(self) -> float:
        """Predicted peak output tokens/s at the current k and acceptance (0 before any
        profile or measured step)."""
        spec = self.engine.engine.spec_stats
        k = spec.current_k
        curve = self.engine.step_times.curve(k, self.config.scheduler.max_num_seqs)
        return peak_tokens_per_second(curve, spec.effective_acceptance_rate, k)

    def spec_state(self) -> SpecState:
        engine = self.engine.engine
        spec_config = self.config.speculative
        controller = engine.controller
        if controller is None:
            return SpecState("none", "none", 0, {}, 0.0)
        sizes = power_of_two_sizes(self.config.scheduler.max_num_seqs)
        return SpecState(spec_config.method, spec_config.controller, engine.spec_stats.current_k,
                         controller.k_table(sizes), engine.spec_stats.acceptance_rate)

    def engine_stats(self) -> dict:
        """The engine's counters and free blocks, after checking its invariants."""
        engine = self.engine.engine
        engine.check_invariants()
        stats = engine.stats()
        pool = engine.block_manager.pool
        return {
            "backend": self.name,
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
            raise EngineUnhealthyError(self._failed)

    async def shutdown(self) -> None:
        await self.engine.shutdown()
        self.engine.engine.worker.close()


def _build_engine(config: TandemConfig, group: ReplicaGroupConfig, context: BackendContext) -> Engine:
    if group.tensor_parallel_size == 1:
        return Engine(config)
    from cluster.parallel.executor import start_tensor_parallel

    config = with_overrides(config, tensor_parallel_size=group.tensor_parallel_size)
    launcher = context.tp_launcher() if context.tp_launcher is not None else None
    return Engine(config, start_tensor_parallel(config, launcher))


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
