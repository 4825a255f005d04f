"""The ingress side of ``POST /v1/responses``: one choice stream, answered as a Responses API
``response`` or as its server-sent events (``cluster/api/responses_output.py``).

The stream is closed exactly once, as in ``deployments/streams.py``: a client that goes away
mid-stream aborts the request in the engine and frees its blocks. A finished response is handed
to ``keep`` (the store) before it is answered, or before a stream's last event, so a client can
retrieve or continue it the moment it has it; an unfinished one is not kept.
"""

from __future__ import annotations

import json
import logging
from typing import AsyncIterator, Awaitable, Callable

from fastapi.responses import JSONResponse

from cluster.api.openai_responses import ChoiceState
from cluster.api.responses_output import ResponseEvents, ResponseIds, output_logprobs, response_object
from cluster.api.responses_protocol import ResponsesRequest
from cluster.api.tool_calls import ToolCallParser
from cluster.routing.group_router import GroupRouter
from deployments.closing_response import ClosingStreamingResponse
from deployments.streams import ChoiceStream

logger = logging.getLogger("ray.serve")


Keep = Callable[[dict], Awaitable[None]]


async def respond_response(stream: ChoiceStream, body: ResponsesRequest, model: str, router: GroupRouter,
                           make_parser: Callable[[], ToolCallParser] | None = None, keep: Keep | None = None):
    """Start the stream (raises ApiError for a refused request) and answer it; ``make_parser``:
    the output may hold function calls (None: plain text); ``keep``: stores the finished response."""
    try:
        await stream.start(router)
    except BaseException:
        stream.close()
        raise
    ids = ResponseIds()
    if body.stream:
        return ClosingStreamingResponse(_events(stream, body, model, ids, make_parser, keep),
                                 media_type="text/event-stream")
    state = ChoiceState(0)
    try:
        async for delta in stream.deltas():
            state.add(delta)
    finally:
        stream.close()
    if make_parser is not None:
        state.set_parsed(make_parser().parse(state.text))
    response = response_object(ids, body, model, state)
    if keep is not None:
        await keep(response)
    return JSONResponse(response)


async def _events(stream: ChoiceStream, body: ResponsesRequest, model: str, ids: ResponseIds,
                  make_parser: Callable[[], ToolCallParser] | None, keep: Keep | None) -> AsyncIterator[str]:
    events = ResponseEvents(ids, body, model)
    parser = make_parser() if make_parser is not None else None
    state = ChoiceState(0)
    finished = False
    pending: list[dict] = []  # logprobs of tokens whose text has not gone out yet (when asked for)
    try:
        for event in events.start():
            yield _sse(event)
        try:
            async for delta in stream.deltas():
                state.add(delta)
                pending += output_logprobs(body, delta.logprobs or []) or []
                if parser is None:
                    content, calls = delta.text, []
                else:  # text goes out as it is known not to be a call; each call once it is whole
                    parsed = parser.feed(delta.text)
                    content, calls = parsed.content, list(parsed.calls)
                    if delta.finish_reason is not None:
                        last = parser.finish()
                        content, calls = content + last.content, calls + list(last.calls)
                if content:
                    for event in events.text(content, pending):
                        yield _sse(event)
                    pending = []
                for call in calls:
                    for event in events.call(call):
                        yield _sse(event)
        except Exception as err:  # an engine failure mid-stream: report it in the stream
            yield _sse(events.error(getattr(err, "message", str(err))))
            finished = True
            return
        if state.finish_reason is None:
            yield _sse(events.error("the replica's stream ended before the response finished"))
            finished = True
            return
        events.more_logprobs(pending)
        last_events = events.finish(state)
        if keep is not None:
            await keep(last_events[-1]["response"])
        for event in last_events:
            yield _sse(event)
        finished = True
    finally:
        if not finished:
            logger.info("response %s: the client went away before it finished; aborted, blocks freed",
                        ids.response_id)
        stream.close()


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
