"""The replica's side of an engine core: ``EngineBackend`` over the core's connection.

A ``tandem-core-reader`` thread reads the core's one message per step, replays its metric
samples, keeps its latest snapshot (what ``load``, ``capacity_tokens_per_second`` and
``spec_state`` answer from, without asking the core) and passes the step's deltas to the
event loop in one call. Each request's stream yields what has arrived for it; when the
consumer (Ray's stream back to the ingress) falls behind, the deltas waiting are merged
into one, so a slow reader costs fewer messages, not more.

If the core goes away (its process or thread ended), every request in flight ends with a
503 error within one read, new requests get the same, and ``check_health`` fails, so Serve
replaces the replica. Where the core lives is the subclass's business
(``ProcessClient``, ``InprocClient``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from multiprocessing.connection import Connection
from typing import AsyncIterator

from cluster.config import TandemConfig
from cluster.hosting.backend import EngineUnhealthyError, SpecState
from cluster.hosting.core_messages import AbortRequest, AddRequest, CallRequest, CallResult, CoreMessage, CoreSnapshot
from cluster.hosting.protocol import ENGINE_UNAVAILABLE, ErrorInfo, GenerateDelta, GenerateRequest, merge_deltas
from cluster.metrics.collector import MetricsSink
from cluster.routing.stats import EngineLoad

logger = logging.getLogger(__name__)


class CoreGoneError(RuntimeError):
    """The engine core stopped; the requests it held are lost."""


class CoreClient:
    name = "native"

    def __init__(self, config: TandemConfig, conn: Connection, sink: MetricsSink | None, max_model_len: int,
                 snapshot: CoreSnapshot, core_pid: int) -> None:
        self.config = config
        self.sink = sink
        self.max_model_len = max_model_len
        self.snapshot = snapshot
        self.core_pid = core_pid
        self._conn = conn
        self._send_lock = threading.Lock()
        self._queues: dict[str, asyncio.Queue] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: str | None = None
        self._stopping = False
        self._reader = threading.Thread(target=self._read, name="tandem-core-reader", daemon=True)
        self._reader.start()

    # ---- what a subclass says about where the core lives ------------------------------------
    def _wait_gone(self) -> str:
        """Block until the core has ended (its connection is closed); why it did."""
        raise NotImplementedError

    def _gone(self) -> str | None:
        """Why the core has ended, if it has (asked by the health check)."""
        raise NotImplementedError

    def _unhealthy(self) -> str | None:
        """Why a core still running cannot serve, as seen from here (None: nothing known)."""
        return None

    # ---- the engine face ----------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        self._loop = asyncio.get_running_loop()
        if self._dead is not None:
            yield _gone_delta(self._dead)
            return
        rid = request.request_id
        if rid in self._queues:
            yield GenerateDelta(error=ErrorInfo(400, f"request id {rid!r} is already in use"))
            return
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        finished = False
        try:
            try:
                self._send(AddRequest(request))
            except OSError as err:  # the core went away before the reader noticed
                finished = True
                yield _gone_delta(f"the engine core is gone ({err})")
                return
            while not finished:
                delta = await queue.get()
                # A reader that fell behind gets what waits merged into one delta (never the acknowledgement).
                while not queue.empty() and isinstance(delta, GenerateDelta) and not (delta.finished or delta.accepted):
                    following = queue.get_nowait()
                    delta = merge_deltas(delta, following) if isinstance(following, GenerateDelta) else following
                if isinstance(delta, CoreGoneError):
                    finished = True
                    yield _gone_delta(str(delta))
                    return
                finished = delta.finished
                yield delta
        finally:
            self._queues.pop(rid, None)
            if not finished and self._dead is None:
                self._abort(rid)

    async def abort(self, request_id: str) -> None:
        self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        try:
            self._send(AbortRequest(request_id))
        except OSError:
            pass  # the core is gone, and the request with it

    def load(self, prefix_depth: int) -> EngineLoad:
        # The core reads its cached prefix hashes to serve.prefix_affinity_blocks, the depth replicas ask for.
        return self.snapshot.load

    def capacity_tokens_per_second(self) -> float:
        return self.snapshot.capacity_tokens_per_second

    def spec_state(self) -> SpecState:
        return self.snapshot.spec_state

    async def engine_stats(self) -> dict:
        """The core's counters and free blocks, after it checked its invariants (asked between steps),
        and the process id the core steps in."""
        return {**(await self._call("engine_stats")), "engine_pid": self.core_pid}

    async def step_timeline(self, last_seconds: float | None = None) -> dict:
        """The core's recent steps and their summary (``step_timeline.py``) over every step kept or
        the last ``last_seconds``."""
        return await self._call("step_timeline", last_seconds)

    async def suffix_history(self, max_requests: int) -> list[list[int]]:
        return await self._call("suffix_history", max_requests)

    async def seed_suffix(self, responses: list[list[int]]) -> int:
        return await self._call("seed_suffix", responses)

    async def _call(self, method: str, *args):
        if self._dead is not None:
            raise EngineUnhealthyError(self._dead)
        self._loop = asyncio.get_running_loop()
        call_id = next(self._call_ids)
        future = self._loop.create_future()
        self._calls[call_id] = future
        self._send(CallRequest(call_id, method, args))
        return await future

    def check_health(self) -> None:
        if self._dead is None:
            self._dead = self._gone()
        failed = self._dead or self.snapshot.failed or self._unhealthy()
        if failed is not None:
            raise EngineUnhealthyError(failed)

    # ---- the hand-off -------------------------------------------------------------------
    def _send(self, message) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _read(self) -> None:
        """The reader thread: one core message at a time until the core goes away."""
        while True:
            try:
                message: CoreMessage = self._conn.recv()
            except (EOFError, OSError):
                break
            if message.snapshot is not None:
                self.snapshot = message.snapshot
            if message.samples is not None and self.sink is not None:
                message.samples.replay(self.sink)
            if message.failure:
                logger.error("engine core: %s", message.failure)
            if (message.deltas or message.calls) and self._loop is not None:
                self._loop.call_soon_threadsafe(self._dispatch, message.deltas, message.calls)
        reason = self._wait_gone()
        if self._stopping:
            return
        self._dead = reason
        logger.error("%s; failing the requests in flight", reason)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fail_all, CoreGoneError(reason))

    def _dispatch(self, deltas: list[tuple[str, GenerateDelta]], calls: list[CallResult]) -> None:
        queues = self._queues
        for rid, delta in deltas:
            queue = queues.get(rid)
            if queue is not None:
                queue.put_nowait(delta)
        for result in calls:
            future = self._calls.pop(result.call_id, None)
            if future is None or future.done():
                continue
            if result.error is not None:
                future.set_exception(EngineUnhealthyError(result.error))
            else:
                future.set_result(result.value)

    def _fail_all(self, error: CoreGoneError) -> None:
        for queue in self._queues.values():
            queue.put_nowait(error)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineUnhealthyError(str(error)))
        self._calls.clear()


def _gone_delta(message: str) -> GenerateDelta:
    return GenerateDelta(error=ErrorInfo(503, f"{message}; the replica is being replaced, retry", "server_error",
                                         code=ENGINE_UNAVAILABLE))
