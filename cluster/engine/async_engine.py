"""Async streaming over the engine, for servers.

One background task owns the engine. It applies queued adds and aborts between
steps, runs ``Engine.step`` in a single worker thread (so the event loop stays
responsive while the model computes) and routes outputs to per-request queues.
A consumer that stops iterating (break, cancel, disconnect) aborts its request,
which frees its blocks before the next step.

``step_time_scale`` > 1 emulates a slower device by sleeping after each step for
(scale - 1) times its duration; it exists for tests and demos of routing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

from cluster.config import TandemConfig
from cluster.engine.engine import Engine
from cluster.shared.outputs import RequestOutput
from cluster.engine.protocol import QueueFullError
from cluster.shared.request import Request
from cluster.shared.sampling_params import SamplingParams
from cluster.metrics.collector import EngineMetricsCollector
from cluster.routing.step_times import StepTimeTracker
from cluster.spec_decode.factory import profile_step_model

logger = logging.getLogger(__name__)


def timed_step(engine: Engine, step_times: StepTimeTracker, step_time_scale: float = 1.0) -> list[RequestOutput]:
    """One ``Engine.step``, stretched to ``step_time_scale`` times its duration (an emulated
    slower device), its time given to ``step_times`` for the router's curve."""
    started = time.perf_counter()
    outputs = engine.step()
    if step_time_scale > 1.0:
        time.sleep((step_time_scale - 1.0) * (time.perf_counter() - started))
    record = engine.last_step
    if record is not None:
        step_times.observe(record.num_seqs, record.k, record.num_prefill_tokens, time.perf_counter() - started)
    return outputs


class EngineDeadError(RuntimeError):
    """The engine loop failed; in-flight requests were failed with this error."""


class AsyncEngine:
    def __init__(self, engine: Engine, step_time_scale: float = 1.0, cumulative: bool = True) -> None:
        """``cumulative=False``: outputs carry only each step's delta (``Engine.add_prepared``)."""
        if step_time_scale < 1.0:
            raise ValueError(f"step_time_scale must be >= 1, got {step_time_scale}")
        self.engine = engine
        self.step_time_scale = step_time_scale
        self.cumulative = cumulative
        self.step_times = StepTimeTracker(*profile_step_model(engine.config))
        self._queues: dict[str, asyncio.Queue] = {}
        self._pending_adds: list[Request] = []
        self._pending_aborts: list[str] = []
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-engine")
        self.metrics: EngineMetricsCollector | None = None  # set by a server that exports metrics

    @classmethod
    def from_config(cls, config: TandemConfig, step_time_scale: float = 1.0) -> "AsyncEngine":
        return cls(Engine(config), step_time_scale)

    @property
    def num_waiting(self) -> int:
        """Requests queued in the engine or about to be."""
        return self.engine.num_waiting + len(self._pending_adds)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Incremental outputs of one request (``lora``: its adapter); the last has ``finished=True``.

        Bad input raises ValueError, and a full queue (``max_queued_requests``)
        QueueFullError, before anything is queued.
        """
        adapters = self.engine.adapters
        if adapters.needs_read(lora):  # read the adapter's folder off the event loop
            adapters.keep(await asyncio.to_thread(adapters.read, lora))
        request = self.engine.make_request(prompt, sampling_params, request_id, cache_salt, lora)
        limit = self.engine.config.scheduler.max_queued_requests
        if limit is not None and self.num_waiting >= limit:
            raise QueueFullError(f"{self.num_waiting} requests are already waiting (max_queued_requests={limit})")
        rid = request.request_id
        if rid in self._queues:
            raise ValueError(f"request id {rid!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        self._pending_adds.append(request)
        self._ensure_loop()
        self._wakeup.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        self._pending_aborts.append(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._apply_pending()
            if not self.engine.has_unfinished():
                self._wakeup.clear()
                if self.metrics is None:
                    await self._wakeup.wait()
                    continue
                # Gauges show the idle engine; Ray drops a gauge that is not set again for a while.
                self.metrics.poll()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), timeout=self.metrics.poll_interval_s)
                except asyncio.TimeoutError:
                    pass
                continue
            try:
                outputs = await loop.run_in_executor(self._executor, self._timed_step)
            except Exception as err:  # a bug or a device failure: fail in-flight requests, keep serving
                logger.exception("engine step failed")
                self._fail_all(EngineDeadError(f"engine step failed: {err}"))
                continue
            if self.metrics is not None:
                self.metrics.on_step(outputs)
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
            await asyncio.sleep(0)  # let consumers run between steps

    def _timed_step(self) -> list[RequestOutput]:
        return timed_step(self.engine, self.step_times, self.step_time_scale)

    def _apply_pending(self) -> None:
        adds, self._pending_adds = self._pending_adds, []
        for request in adds:
            if request.request_id in self._pending_aborts:
                continue
            try:
                self.engine.add_prepared(request, self.cumulative)
            except ValueError as err:
                queue = self._queues.get(request.request_id)
                if queue is not None:
                    queue.put_nowait(err)
        aborts, self._pending_aborts = self._pending_aborts, []
        for rid in aborts:
            self._abort_now(rid)

    def _abort_now(self, request_id: str) -> None:
        if self.metrics is not None and request_id in self.engine.scheduler.requests:
            self.metrics.on_abort(request_id)
        self.engine.abort(request_id)

    def _fail_all(self, error: BaseException) -> None:
        for rid in list(self.engine.scheduler.requests):
            self._abort_now(rid)
            queue = self._queues.get(rid)
            if queue is not None:
                queue.put_nowait(error)

    async def shutdown(self) -> None:
        """Abort everything in flight and stop the loop."""
        for rid in list(self._queues):
            self.abort(rid)
        if self._loop_task is not None:
            self._apply_pending()
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)
