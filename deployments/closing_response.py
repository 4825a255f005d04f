"""A streamed answer that always closes its event generator.

Starlette streams a response in one task and listens for the client's disconnect in another;
when the client goes away (even right after the last event, as a client that read ``[DONE]``
does) the sending task is cancelled where it stands and the generator is left suspended, not
closed. Its ``finally``, which closes the request's choice streams (aborting the engine request
and counting it out of the router's in-flight calls), would then run only when the garbage
collector finds it, and Ray Serve freezes the collector at start: a drain would wait for a call
that ended long ago."""

from __future__ import annotations

from fastapi.responses import StreamingResponse


class ClosingStreamingResponse(StreamingResponse):
    """``StreamingResponse`` over an async generator that is closed however the response ends."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
