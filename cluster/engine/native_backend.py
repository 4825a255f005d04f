"""Tandem's own engine behind ``EngineBackend``: an ``AsyncEngine`` (target + draft +
speculation controller) with its metrics collector.

A group with ``tensor_parallel_size`` > 1 splits the target over this process (rank 0)
and further ranks started by ``context.tp_launcher`` (Ray actors in a cluster) or, without
one, by local processes.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator

from cluster.config import TandemConfig, with_overrides
from cluster.config_serve import ReplicaGroupConfig
from cluster.engine.async_engine import AsyncEngine, EngineDeadError
from cluster.engine.backend import BackendContext, EngineUnhealthyError, SpecState, input_error
from cluster.engine.engine import Engine
from cluster.engine.engine_view import EngineView, output_delta
from cluster.engine.protocol import ErrorInfo, GenerateDelta, GenerateRequest, QueueFullError
from cluster.metrics.collector import EngineMetricsCollector
from cluster.routing.stats import EngineLoad
from cluster.runner.tp_executor import TensorParallelError, start_tensor_parallel
from cluster.shared.outputs import RequestOutput

logger = logging.getLogger(__name__)


class NativeBackend:
    name = "native"

    def __init__(self, config: TandemConfig, group: ReplicaGroupConfig, context: BackendContext) -> None:
        self.config = config
        self.engine = AsyncEngine(_build_engine(config, group, context), step_time_scale=group.step_time_scale,
                                  cumulative=False)  # it streams deltas (output_delta)
        if context.metrics_sink is not None:
            self.engine.metrics = EngineMetricsCollector(self.engine.engine, context.metrics_sink,
                                                         capacity=lambda: self.view.capacity_tokens_per_second())
        self.max_model_len = self.engine.engine.max_model_len
        self.view = EngineView(self.engine.engine, self.engine.step_times, config, lambda: self.engine.num_waiting)
        self._failed: str | None = None

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        try:
            stream = self.engine.generate(request.prompt_token_ids, request.sampling_params, request.request_id,
                                          request.cache_salt, request.lora)
            first = await _first_or_error(stream)
        except QueueFullError as err:
            yield GenerateDelta(error=ErrorInfo(429, str(err), "rate_limit_error"))
            return
        except ValueError as err:
            yield GenerateDelta(error=input_error(err))
            return
        except EngineDeadError as err:  # the engine failed before this request's first token
            self._failed = str(err)
            yield GenerateDelta(error=ErrorInfo(500, f"the engine failed: {err}", "server_error"))
            return
        yield GenerateDelta(accepted=True, num_prompt_tokens=len(request.prompt_token_ids))
        try:
            if first is not None:
                yield output_delta(first)
                if first.finished:
                    return
                async for out in stream:
                    yield output_delta(out)
        except EngineDeadError as err:
            self._failed = str(err)
            yield GenerateDelta(error=ErrorInfo(500, f"the engine failed: {err}", "server_error"))
        finally:
            await stream.aclose()

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def load(self, prefix_depth: int) -> EngineLoad:
        return self.view.load(prefix_depth)

    def capacity_tokens_per_second(self) -> float:
        return self.view.capacity_tokens_per_second()

    def spec_state(self) -> SpecState:
        return self.view.spec_state()

    async def engine_stats(self) -> dict:
        return self.view.engine_stats(self.name)

    async def step_timeline(self, last_seconds: float | None = None) -> dict:
        return {"note": "the step timeline is recorded by Tandem's engine-core process (engine.core_process), "
                        "not by the in-process engine"}

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
    config = with_overrides(config, tensor_parallel_size=group.tensor_parallel_size)
    launcher = context.tp_launcher() if context.tp_launcher is not None else None
    return Engine(config, start_tensor_parallel(config, launcher))


async def _first_or_error(stream: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    """Start the stream so validation errors surface here, before the acknowledgement."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None
