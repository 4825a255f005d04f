"""The engine core in a process of its own (``core_process``), driven from the replica.

The replica's process keeps only the hand-off (``CoreClient``); the step never waits on the
replica's event loop or shares its GIL with Ray's per-request calls. If the core process
dies, the requests in flight end with a 503 and the health check fails.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection

from cluster.config import TandemConfig
from cluster.config_serve import ReplicaGroupConfig
from cluster.hosting.backend import BackendContext
from cluster.hosting.core_client import CoreClient
from cluster.hosting.core_messages import CoreMessage, CoreReady, CoreStart, Shutdown

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 900.0  # building the engine may convert a model first
SHUTDOWN_TIMEOUT_S = 10.0


class ProcessClient(CoreClient):
    def __init__(self, config: TandemConfig, group: ReplicaGroupConfig, context: BackendContext) -> None:
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen([sys.executable, "-m", "cluster.hosting.core_process", str(theirs.fileno())],
                                        pass_fds=[theirs.fileno()], env=os.environ.copy())
        theirs.close()
        conn = Connection(ours.detach())
        conn.send(CoreStart(config.model_dump(), group.step_time_scale))
        ready = self._wait_ready(conn)
        super().__init__(config, conn, context.metrics_sink, ready.max_model_len, ready.snapshot, ready.pid)
        logger.info("engine core started in process %d", ready.pid)

    def _wait_ready(self, conn: Connection) -> CoreReady:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not conn.poll(1.0):
            if self.process.poll() is not None:
                raise RuntimeError(f"the engine core exited with {self.process.returncode} before it was ready "
                                   "(its log is in this replica's stderr)")
            if time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError(f"the engine core was not ready within {START_TIMEOUT_S:.0f} s")
        message = conn.recv()
        if isinstance(message, CoreMessage) and message.failure:
            self.process.wait(timeout=30)
            raise RuntimeError(message.failure)
        return message

    def _wait_gone(self) -> str:
        return f"the engine process exited with {self.process.wait()}"

    def _gone(self) -> str | None:
        code = self.process.poll()
        return None if code is None else f"the engine process exited with {code}"

    async def shutdown(self) -> None:
        self._stopping = True
        if self.process.poll() is None:
            try:
                self._send(Shutdown())
            except OSError:
                pass
            try:
                await asyncio.get_running_loop().run_in_executor(None, self.process.wait, SHUTDOWN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self._conn.close()
