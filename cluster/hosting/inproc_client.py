"""The engine core in a thread of the replica's process, driven like the one in its own.

For groups whose engine the replica must build itself: tensor-parallel groups (their further
ranks are started from here, by ``context.tp_launcher`` in a cluster or as local processes)
and ``engine.core_process: false``. The core is the same ``EngineCore`` speaking the same
messages over a socket pair, so admission, limits, adapters, failure and the step timeline
behave as with ``ProcessClient``; only its step shares the replica's GIL.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from multiprocessing.connection import Connection

from cluster.config import TandemConfig, with_overrides
from cluster.config_serve import ReplicaGroupConfig
from cluster.engine.engine import Engine
from cluster.hosting.backend import BackendContext
from cluster.hosting.core import EngineCore, close_engine
from cluster.hosting.core_client import CoreClient
from cluster.hosting.core_messages import Shutdown
from cluster.metrics.collector import MetricsSink
from cluster.runner.tp_executor import TensorParallelError, start_tensor_parallel

logger = logging.getLogger(__name__)


class InprocClient(CoreClient):
    def __init__(self, engine: Engine, step_time_scale: float = 1.0, metrics_sink: MetricsSink | None = None) -> None:
        """Serve ``engine`` (built by the caller; it is closed with the client)."""
        self.engine = engine
        self.core = EngineCore(engine, step_time_scale)
        ours, theirs = socket.socketpair()
        core_end = Connection(theirs.detach())
        self._ended: str | None = None
        self._thread = threading.Thread(target=self._serve, args=(core_end,), name="tandem-engine-core", daemon=True)
        super().__init__(engine.config, Connection(ours.detach()), metrics_sink, engine.max_model_len,
                         self.core.snapshot(), os.getpid())
        self._thread.start()

    @classmethod
    def for_group(cls, config: TandemConfig, group: ReplicaGroupConfig, context: BackendContext) -> "InprocClient":
        """A group's engine, split over ``group.tensor_parallel_size`` ranks when above 1."""
        if group.tensor_parallel_size == 1:
            engine = Engine(config)
        else:
            config = with_overrides(config, tensor_parallel_size=group.tensor_parallel_size)
            launcher = context.tp_launcher() if context.tp_launcher is not None else None
            engine = Engine(config, start_tensor_parallel(config, launcher))
        return cls(engine, group.step_time_scale, context.metrics_sink)

    def _serve(self, conn: Connection) -> None:
        try:
            self.core.run(conn)
        except (EOFError, BrokenPipeError, ConnectionResetError):
            self._ended = "the replica closed the engine core's connection"
        except BaseException as err:  # a bug in the loop itself (a failed step is handled inside)
            logger.exception("the engine core's loop failed")
            self._ended = f"the engine core's loop failed: {type(err).__name__}: {err}"
        else:
            self._ended = "the engine core stopped"
        finally:
            conn.close()  # the reader sees the end and fails what is in flight

    def _wait_gone(self) -> str:
        self._thread.join()
        return self._ended or "the engine core stopped"

    def _gone(self) -> str | None:
        if not self._thread.is_alive() and self._thread.ident is not None:
            return self._ended or "the engine core stopped"
        return None

    def _unhealthy(self) -> str | None:
        executor = getattr(self.engine.worker.runner, "executor", None)
        if executor is not None:
            try:
                executor.check_alive()  # a dead tensor-parallel rank: unhealthy before any request fails
            except TensorParallelError as err:
                return str(err)
        return None

    async def shutdown(self) -> None:
        self._stopping = True
        try:
            self._send(Shutdown())
        except OSError:
            pass
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self._conn.close()
        close_engine(self.engine)
