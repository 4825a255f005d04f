"""The ingress side of ``POST /v1/responses``: one choice stream, answered as a Responses API
``response`` or as its server-sent events (``cluster/api/responses_output.py``).

The stream is closed exactly once, as in ``deployments/streams.py``: a client that goes away
mid-stream aborts the request in the engine and frees its blocks.
"""

from __future__ import annotations

import json
import logging
from typing import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from cluster.api.openai_responses import ChoiceState
from cluster.api.responses_output import ResponseEvents, ResponseIds, response_object
from cluster.api.responses_protocol import ResponsesRequest
from cluster.routing.group_router import GroupRouter
from deployments.streams import ChoiceStream

logger = logging.getLogger("ray.serve")


async def respond_response(stream: ChoiceStream, body: ResponsesRequest, model: str, router: GroupRouter):
    """Start the stream (raises ApiError for a refused request) and answer it."""
    try:
        await stream.start(router)
    except BaseException:
        stream.close()
        raise
    ids = ResponseIds()
    if body.stream:
        return StreamingResponse(_events(stream, body, model, ids), media_type="text/event-stream")
    state = ChoiceState(0)
    try:
        async for delta in stream.deltas():
            state.add(delta)
    finally:
        stream.close()
    return JSONResponse(response_object(ids, body, model, state))


async def _events(stream: ChoiceStream, body: ResponsesRequest, model: str, ids: ResponseIds) -> AsyncIterator[str]:
    events = ResponseEvents(ids, body, model)
    state = ChoiceState(0)
    finished = False
    try:
        for event in events.start():
            yield _sse(event)
        try:
            async for delta in stream.deltas():
                state.add(delta)
                if delta.text:
                    yield _sse(events.delta(delta.text))
        except Exception as err:  # an engine failure mid-stream: report it in the stream
            yield _sse(events.error(getattr(err, "message", str(err))))
            finished = True
            return
        if state.finish_reason is None:
            yield _sse(events.error("the replica's stream ended before the response finished"))
            finished = True
            return
        for event in events.finish(state):
            yield _sse(event)
        finished = True
    finally:
        if not finished:
            logger.info("response %s: the client went away before it finished; aborted, blocks freed",
                        ids.response_id)
        stream.close()


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
