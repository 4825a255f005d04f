"""The engine core: the one host of ``Engine.step``.

It owns everything between a replica and the engine: admission (input errors, the 429
queue limit, LoRA adapters read in a thread while the engine steps on), the step loop,
failure (a step that raises fails the requests in flight with a 500 and marks the core
failed, so the replica's health check fails and Serve replaces it), the metric samples,
the readings the router needs, and the step timeline.

It speaks only messages (``core_messages``) over a ``multiprocessing`` connection:
``run(conn)`` loops taking every message waiting (adds, aborts, calls; blocking only when
there is no work), running one step, and sending one ``CoreMessage`` with every request's
delta of that step. Two clients drive it, with the same messages: ``ProcessClient`` (the
core in a process of its own, ``core_process``, so the step never shares a GIL with Ray's
per-request calls, as vLLM keeps its engine core apart) and ``InprocClient`` (the core in a
thread of the replica's process: tensor-parallel groups, whose ranks the replica starts,
and ``engine.core_process: false``).
"""

from __future__ import annotations

import logging
import time
from multiprocessing.connection import Connection

from cluster.engine.engine import Engine
from cluster.hosting.backend import input_error
from cluster.hosting.core_messages import (AbortRequest, AddRequest, CallRequest, CallResult, CoreMessage,
                                           CoreSnapshot, Shutdown)
from cluster.hosting.engine_view import EngineView, output_delta
from cluster.hosting.protocol import ENGINE_UNAVAILABLE, ErrorInfo, GenerateDelta
from cluster.hosting.step_timeline import StepTimeline, TimelineEntry
from cluster.metrics.collector import EngineMetricsCollector
from cluster.metrics.sample_buffer import BufferedSink
from cluster.routing.step_times import StepTimeTracker
from cluster.shared.outputs import RequestOutput
from cluster.spec_decode.factory import profile_step_model

logger = logging.getLogger(__name__)

SNAPSHOT_PERIOD_S = 0.05  # how stale the router's view of this engine may be while it steps
IDLE_POLL_S = 1.0  # an idle core still refreshes its gauges this often (Ray drops stale ones)
READ_POLL_S = 0.005  # how often a core with nothing to step looks whether an adapter read ended


def timed_step(engine: Engine, step_times: StepTimeTracker, step_time_scale: float = 1.0) -> list[RequestOutput]:
    """One ``Engine.step``, stretched to ``step_time_scale`` times its duration (an emulated
    slower device, for tests and demos of routing), its time given to ``step_times`` for the
    router's curve."""
    started = time.perf_counter()
    outputs = engine.step()
    if step_time_scale > 1.0:
        time.sleep((step_time_scale - 1.0) * (time.perf_counter() - started))
    record = engine.last_step
    if record is not None:
        step_times.observe(record.num_seqs, record.k, record.num_prefill_tokens, time.perf_counter() - started)
    return outputs


def close_engine(engine: Engine) -> None:
    """Release what the engine holds outside Python: the adapter reader, the worker (and its ranks)."""
    engine.adapters.close()
    engine.worker.close()


class EngineCore:
    def __init__(self, engine: Engine, step_time_scale: float = 1.0) -> None:
        self.engine = engine
        self.config = engine.config
        self.step_time_scale = step_time_scale
        self.step_times = StepTimeTracker(*profile_step_model(engine.config))
        self.view = EngineView(engine, self.step_times, engine.config)
        self.sink = BufferedSink()
        self.metrics = EngineMetricsCollector(engine, self.sink, capacity=self.view.capacity_tokens_per_second)
        self.failed: str | None = None
        self.log_requests = engine.config.serve.log_requests  # a line per request's start and end
        self.timeline = StepTimeline()
        self._out = CoreMessage()
        self._last_snapshot = float("-inf")

    # ---- messages from the replica -------------------------------------------------
    def handle(self, message) -> bool:
        """Apply one message; False when it asks the core to stop."""
        if isinstance(message, AddRequest):
            self._add(message)
        elif isinstance(message, AbortRequest):
            self._abort(message.request_id)
        elif isinstance(message, CallRequest):
            self._out.calls.append(self._call(message))
        elif isinstance(message, Shutdown):
            return False
        else:
            logger.error("engine core: unknown message %r", type(message).__name__)
        return True

    def _add(self, message: AddRequest) -> None:
        request = message.request
        rid = request.request_id
        limit = self.config.scheduler.max_queued_requests
        if limit is not None and self.engine.num_waiting >= limit:
            text = f"{self.engine.num_waiting} requests are already waiting (max_queued_requests={limit})"
            self._out.deltas.append((rid, GenerateDelta(error=ErrorInfo(429, text, "rate_limit_error"))))
            return
        adapters = self.engine.adapters
        try:
            if adapters.needs_read(request.lora):  # read in a thread; the engine steps on meanwhile
                adapters.read_later(request.lora, rid, message)
                return
        except ValueError as err:
            self._out.deltas.append((rid, GenerateDelta(error=input_error(err))))
            return
        self._admit(message)

    def _admit(self, message: AddRequest) -> None:
        request = message.request
        rid = request.request_id
        try:
            prepared = self.engine.make_request(request.prompt_token_ids, request.sampling_params, rid,
                                                request.cache_salt, request.lora)
            self.engine.add_prepared(prepared, cumulative=False)  # the replica streams deltas
        except ValueError as err:
            if self.log_requests:
                logger.info("request %s refused: %s", rid, err, extra={"request_id": rid})
            self._out.deltas.append((rid, GenerateDelta(error=input_error(err))))
            return
        if self.log_requests:
            params = request.sampling_params
            logger.info("request %s added: %d prompt tokens, max_tokens %d, temperature %g%s", rid,
                        len(request.prompt_token_ids), params.max_tokens, params.temperature,
                        f", adapter {request.lora}" if request.lora else "", extra={"request_id": rid})
        self._out.deltas.append((rid, GenerateDelta(accepted=True, num_prompt_tokens=len(request.prompt_token_ids))))

    def take_reads(self) -> None:
        """Admit the requests whose adapter has been read; fail those whose adapter could not be."""
        for message, error in self.engine.adapters.reads_done():
            if error is None:
                self._admit(message)
                continue
            info = input_error(error) if isinstance(error, ValueError) else ErrorInfo(
                500, f"reading LoRA adapter {message.request.lora!r} failed: {error}", "server_error")
            self._out.deltas.append((message.request.request_id, GenerateDelta(error=info)))

    def _abort(self, request_id: str) -> None:
        if request_id in self.engine.scheduler.requests:
            self.metrics.on_abort(request_id)
            if self.log_requests:
                logger.info("request %s aborted", request_id, extra={"request_id": request_id})
        self.engine.abort(request_id)

    def _call(self, message: CallRequest) -> CallResult:
        try:
            if message.method == "engine_stats":
                return CallResult(message.call_id, self.view.engine_stats("native"))
            if message.method == "step_timeline":
                seconds = message.args[0] if message.args else None  # None: every step kept
                return CallResult(message.call_id, {"summary": self.timeline.summary(seconds, time.monotonic()),
                                                    "last_10s": self.timeline.summary(10.0, time.monotonic()),
                                                    "recent": self.timeline.recent()})
            if message.method == "suffix_history":
                return CallResult(message.call_id, self.engine.suffix_history(*message.args))
            if message.method == "seed_suffix":
                return CallResult(message.call_id, self.engine.seed_suffix(*message.args))
            return CallResult(message.call_id, error=f"the engine core has no call {message.method!r}")
        except Exception as err:  # an invariant broken: report it to the caller, keep serving
            return CallResult(message.call_id, error=f"{type(err).__name__}: {err}")

    # ---- the loop ---------------------------------------------------------------------
    def step(self) -> bool:
        """One engine step and its outputs queued for the replica; False when it failed."""
        try:
            outputs = timed_step(self.engine, self.step_times, self.step_time_scale)
        except Exception as err:  # a bug or a device failure: fail in-flight requests, report unhealthy
            logger.exception("engine step failed")
            self._fail_all(f"engine step failed: {err}")
            return False
        self.metrics.on_step(outputs)
        self._out.deltas.extend((out.request_id, output_delta(out)) for out in outputs)
        if self.log_requests:
            for out in outputs:
                if out.finished:
                    logger.info("request %s finished: %s after %d output tokens", out.request_id,
                                out.outputs[0].finish_reason, out.usage.completion_tokens,
                                extra={"request_id": out.request_id})
        return True

    def _fail_all(self, message: str) -> None:
        self.failed = message
        error = GenerateDelta(error=ErrorInfo(500, f"the engine failed: {message}", "server_error",
                                              code=ENGINE_UNAVAILABLE))
        for rid in list(self.engine.scheduler.requests):
            self._abort(rid)
            self._out.deltas.append((rid, error))

    def take_message(self, now: float, force_snapshot: bool = False) -> CoreMessage | None:
        """What to send now: the deltas and samples gathered since the last message, and a
        fresh snapshot when the last one is older than ``SNAPSHOT_PERIOD_S``."""
        out = self._out
        if force_snapshot or now - self._last_snapshot >= SNAPSHOT_PERIOD_S:
            out.snapshot = self.snapshot()
            self._last_snapshot = now
        out.samples = self.sink.drain()
        self._out = CoreMessage()
        return out if out else None

    def snapshot(self) -> CoreSnapshot:
        view = self.view
        return CoreSnapshot(view.load(self.config.serve.prefix_affinity_blocks), view.capacity_tokens_per_second(),
                            view.spec_state(), self.failed)

    def run(self, conn: Connection) -> None:
        """Serve the replica on ``conn`` until it closes it or sends ``Shutdown``."""
        clock = time.monotonic
        while True:
            started = clock()
            timeout = 0.0 if self.engine.has_unfinished() else IDLE_POLL_S
            if timeout and self.engine.adapters.num_reading:
                timeout = READ_POLL_S
            idle = 0.0
            handled = False
            while True:
                waiting = clock()
                ready = conn.poll(timeout)
                if timeout:  # blocked for want of work
                    idle += clock() - waiting
                if not ready:
                    break
                try:
                    message = conn.recv()
                except EOFError:
                    return
                if not self.handle(message):
                    return
                handled, timeout = True, 0.0
            self.take_reads()
            stepping = clock()
            record = None
            if self.engine.has_unfinished() and self.step():
                record = self.engine.last_step
            elif not handled:
                self.metrics.poll(stepping)
            sending = clock()
            message = self.take_message(sending, force_snapshot=not self.engine.has_unfinished())
            if message is not None:
                conn.send(message)
            if record is not None:
                self.timeline.record(TimelineEntry(
                    started, idle, stepping - started - idle, sending - stepping, record.execute_seconds,
                    clock() - sending, record.num_seqs, record.num_tokens, record.num_output_tokens, record.k,
                    record.num_prefill_tokens))

