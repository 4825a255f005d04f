"""The token deltas one replica holds for one ingress's feed until the feed takes them.

A replica's requests that name the same feed (``GenerateRequest.feed``) put their token
deltas here instead of streaming each on its own; the feed (``FeedRequest``) takes
everything waiting in one item. A request's deltas that wait together are merged into
one, so a feed that falls behind gets fewer, larger items, never more.
"""

from __future__ import annotations

import asyncio

from cluster.hosting.protocol import GenerateDelta, merge_deltas


class FeedOutbox:
    def __init__(self) -> None:
        self._waiting: dict[str, GenerateDelta] = {}
        self._wake = asyncio.Event()
        self.live = 0  # requests of this feed in flight on the replica
        self.readers = 0  # feed streams open on it

    @property
    def idle(self) -> bool:
        """Nothing waiting, no request in flight and no feed reading: the replica may forget it."""
        return not self._waiting and self.live == 0 and self.readers == 0

    def put(self, request_id: str, delta: GenerateDelta) -> None:
        earlier = self._waiting.get(request_id)
        self._waiting[request_id] = delta if earlier is None else merge_deltas(earlier, delta)
        self._wake.set()

    def drop(self, request_id: str) -> None:
        """Forget a request's waiting deltas (it was aborted: nobody reads them)."""
        self._waiting.pop(request_id, None)

    async def take(self, idle_seconds: float) -> list[tuple[str, GenerateDelta]] | None:
        """Everything waiting (at least one delta), in the order the requests first put; None once
        ``idle_seconds`` passed with nothing waiting and no request in flight."""
        while not self._waiting:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), idle_seconds)
            except asyncio.TimeoutError:
                if not self._waiting and self.live == 0:
                    return None
        items = list(self._waiting.items())
        self._waiting.clear()
        return items
