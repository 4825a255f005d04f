"""The ingress's side of delta feeds: one stream of token deltas from each replica it has
requests on, instead of one stream per request.

Ray Serve carries every streamed item as a call of its own (serialized by the replica,
received and deserialized here), so a stream per request costs each token of each request
that much; a feed costs it once per engine step for all of this ingress's requests on the
replica (``TandemReplica.feed``, ``FeedOutbox``). A request still makes its own call (so
Serve routes it, counts it and cancels it), which answers its acknowledgement and stays open
until the request ends. Each choice registers a queue under its request id before it calls;
the feed of the replica that acknowledged it puts that request's deltas there. A feed
that fails (its replica died) fails every request on it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from ray.serve.handle import DeploymentHandle

from cluster.hosting.protocol import FeedRequest

logger = logging.getLogger("ray.serve")

# A feed that ended without carrying anything (its replica ended it idle, or it went to another
# replica than the one it names) is opened again after this pause while requests still wait on it.
REOPEN_PAUSE_SECONDS = 0.05


class FeedLostError(Exception):
    status = 503

    def __init__(self, replica_id: str, cause: BaseException) -> None:
        self.message = f"the token stream from replica {replica_id} failed ({type(cause).__name__}); retry"
        super().__init__(self.message)


class DeltaFeeds:
    def __init__(self) -> None:
        self.feed_id = uuid.uuid4().hex
        self._queues: dict[str, asyncio.Queue] = {}  # request id -> where its deltas go
        self._waiting: dict[str, set[str]] = {}  # replica id -> request ids that read its feed
        self._readers: dict[str, asyncio.Task] = {}  # replica id -> the task that reads its feed
        self._tasks: set[asyncio.Task] = set()  # the choices' watchers (asyncio keeps no task alive by itself)

    def register(self, request_id: str) -> asyncio.Queue:
        """The queue a request's deltas (or the error that ends it) will arrive on."""
        queue = self._queues[request_id] = asyncio.Queue()
        return queue

    def attach(self, request_id: str, replica_id: str, handle: DeploymentHandle) -> None:
        """The request was acknowledged by ``replica_id`` (of the group ``handle`` reaches): read
        that replica's feed while it waits."""
        self._waiting.setdefault(replica_id, set()).add(request_id)
        if replica_id not in self._readers:
            self._readers[replica_id] = asyncio.get_running_loop().create_task(
                self._read(replica_id, handle), name=f"tandem-feed-{replica_id}")

    def spawn(self, coroutine) -> asyncio.Task:
        """Run a choice's watcher of its call, kept alive until it ends."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def unregister(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        for replica_id, waiting in list(self._waiting.items()):
            waiting.discard(request_id)
            if not waiting:
                del self._waiting[replica_id]

    async def _read(self, replica_id: str, handle: DeploymentHandle) -> None:
        subscription = FeedRequest(self.feed_id, replica_id)
        try:
            while self._waiting.get(replica_id):
                carried = False
                async for items in handle.options(stream=True).feed.remote(subscription):
                    carried = True
                    for request_id, delta in items:
                        queue = self._queues.get(request_id)
                        if queue is not None:  # else the request was closed: nobody reads it
                            queue.put_nowait(delta)
                if not carried:
                    await asyncio.sleep(REOPEN_PAUSE_SECONDS)
        except Exception as err:  # the replica died or the call failed: every request on it fails
            logger.warning("feed from replica %s failed: %r", replica_id, err)
            lost = FeedLostError(replica_id, err)
            for request_id in self._waiting.pop(replica_id, ()):
                queue = self._queues.get(request_id)
                if queue is not None:
                    queue.put_nowait(lost)
        finally:
            self._readers.pop(replica_id, None)
