"""The ingress side of generation: one ``ChoiceStream`` per choice (prompt x n), each a
streaming call to a replica of the group the router chose, merged into one OpenAI
response or one server-sent-event stream. With delta feeds (``deployments/feeds.py``)
the call answers only the acknowledgement and the tokens come by the replica's feed.

Every stream is closed when it ends (``ChoiceStream.close``): that cancels the replica
call if it is still running (which aborts the request in the engine and frees its
blocks) and tells the router the request left the group. A client that disconnects
mid-stream cancels the response generator, whose ``finally`` closes the streams. A choice
whose engine died or failed before its first token reached the client is sent once more
(its failed call closed first), to another group that may serve it, else to another
replica of its group; the client sees only the second answer. So is a call still waiting
for its acknowledgement when its group loses its last running replica (a node gone: Serve
would hold the call until a replacement starts) while another group can take it.

When the request offers tools, each choice's text goes through a ``ToolCallParser``
(``make_parser``): whole responses parse the full text, streams feed it delta by delta and
send the calls as ``delta.tool_calls`` the moment each is complete.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from typing import AsyncIterator, Callable

from fastapi.responses import JSONResponse
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from cluster.api import openai_responses as responses
from cluster.api.tool_calls import ToolCallParser
from cluster.hosting.protocol import ENGINE_UNAVAILABLE, GenerateDelta, GenerateRequest
from cluster.routing.group_router import GroupRouter
from cluster.routing.stats import ReplicaStats
from deployments.closing_response import ClosingStreamingResponse
from deployments.feeds import DeltaFeeds

logger = logging.getLogger("ray.serve")
ACK_CHECK_SECONDS = 1.0  # how often a call waiting for its acknowledgement checks that its group still runs


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


class ChoiceStream:
    """One choice of a request: its engine request for each group it may go to
    (``cluster.api.engine_requests.choice_requests``), of which ``start`` sends one."""

    def __init__(self, index: int, prompt_index: int, requests: dict[str, GenerateRequest],
                 groups: dict[str, DeploymentHandle], echo: responses.Echo | None = None,
                 tokens_as_ids: bool = False, feeds: DeltaFeeds | None = None) -> None:
        """``feeds``: the ingress's delta feeds, which carry the tokens (None: the call's own stream)."""
        self.index = index
        self.echo = echo  # what goes before the output (``echo``)
        self.tokens_as_ids = tokens_as_ids  # logprobs name tokens token_id:N (``return_tokens_as_token_ids``)
        self.prompt_index = prompt_index
        self.requests = requests
        self.request_id = next(iter(requests.values())).request_id
        self.groups = groups
        self.group: str | None = None
        self._call: DeploymentResponseGenerator | None = None
        self._router: GroupRouter | None = None
        self._counted = False  # the router counts this choice in flight in ``group``
        self._done = False
        self._feeds = feeds
        self._queue: asyncio.Queue | None = None  # where the feed puts this choice's deltas
        self.replica_id: str | None = None  # the replica that acknowledged (or refused) it
        self._retried = False  # sent once more after its engine failed
        self._streamed = False  # a token has reached the client: no retry past this

    @property
    def prompt_token_ids(self) -> list[int]:
        return next(iter(self.requests.values())).prompt_token_ids

    async def start(self, router: GroupRouter) -> None:
        """Route, call the replica and wait for its acknowledgement (raises ApiError). A replica
        whose engine is gone or failed (``ENGINE_UNAVAILABLE``) gets the request sent once more,
        to another replica or group where there is one."""
        try:
            await self._send(router)
        except ApiError as err:
            if not self._may_retry(err.code):
                raise
            await self._retry()
        except _GroupLost:
            if not self._may_retry(ENGINE_UNAVAILABLE):
                raise ApiError(503, f"replica group {self.group!r} has no running replica; retry", "server_error",
                               code=ENGINE_UNAVAILABLE) from None
            await self._retry()
        except BackPressureError:
            raise  # the replicas are full, not gone: answered with a 503
        except Exception:  # the replica's process died under the call (Serve's actor error)
            if not self._may_retry(ENGINE_UNAVAILABLE):
                raise
            self._done = True
            await self._retry()

    async def _send(self, router: GroupRouter, avoid_group: str | None = None,
                    avoid_replica: str | None = None) -> None:
        self._router = router
        others = {group: r.routing for group, r in self.requests.items() if group != avoid_group}
        self.group = router.choose(others or {group: r.routing for group, r in self.requests.items()}, time.time())
        self._counted = True
        request = self.requests[self.group]
        if avoid_replica is not None:
            request = dataclasses.replace(request, routing=dataclasses.replace(request.routing,
                                                                               avoid_replica=avoid_replica))
        if self._feeds is not None:
            self._queue = self._feeds.register(self.request_id)
            request = dataclasses.replace(request, feed=self._feeds.feed_id)
        self._call = self.groups[self.group].options(stream=True).generate.remote(request)
        self._done = False
        ack = await self._acknowledgement(router)
        self.replica_id = ack.replica_id
        if ack.error is not None:
            self._done = True
            raise ApiError(ack.error.status, ack.error.message, ack.error.type, ack.error.param, ack.error.code)
        if ack.replica_stats:
            router.observe(ReplicaStats.from_dict(ack.replica_stats))
        if self._queue is not None:
            self._feeds.attach(self.request_id, ack.replica_stats["replica_id"], self.groups[self.group])
            self._feeds.spawn(self._watch_call())

    async def _acknowledgement(self, router: GroupRouter) -> GenerateDelta:
        """The call's first delta; raises _GroupLost if, while it waits, the group loses its last
        running replica and another group could take the request."""
        waiting = asyncio.ensure_future(self._call.__anext__())
        try:
            while True:
                done, _ = await asyncio.wait({waiting}, timeout=ACK_CHECK_SECONDS)
                if done:
                    return waiting.result()
                if router.may_leave(self.group, self.requests):
                    raise _GroupLost()
        finally:
            if not waiting.done():
                waiting.cancel()

    def _may_retry(self, code: str | None) -> bool:
        """Whether a failure may go to another replica: the engine's, not the request's, once, and
        before any token reached the client."""
        return code == ENGINE_UNAVAILABLE and not self._retried and not self._streamed

    async def _retry(self) -> None:
        failed_group, failed_replica = self.group, self.replica_id
        what = (f"replica {failed_replica} of group {failed_group} failed it" if failed_replica is not None
                else f"group {failed_group} failed it (its replica gone, or no replica left running)")
        logger.warning("request %s: %s before its first token; sending it elsewhere", self.request_id, what)
        self._retried = True
        self._router.note_retry(failed_group)
        self.close()
        others = len(self.requests) > 1
        await self._send(self._router, failed_group if others else None,
                         None if others else failed_replica)

    async def _watch_call(self) -> None:
        """The call carries nothing after the acknowledgement; its failure ends the choice."""
        try:
            async for _ in self._call:
                pass
        except Exception as err:  # the replica failed (or close() cancelled the call: nobody reads then)
            self._queue.put_nowait(err)

    async def deltas(self) -> AsyncIterator[GenerateDelta]:
        while True:
            try:
                async for delta in self._deltas_once():
                    yield delta
                return
            except _Retryable:
                await self._retry()

    async def _deltas_once(self) -> AsyncIterator[GenerateDelta]:
        try:
            async for delta in (self._call if self._queue is None else self._fed()):
                if delta.error is not None:
                    self._done = True
                    if self._may_retry(delta.error.code):
                        raise _Retryable()
                    raise ApiError(delta.error.status, delta.error.message, delta.error.type, delta.error.param,
                                   delta.error.code)
                if delta.token_ids or delta.text:
                    self._streamed = True
                yield responses.with_token_id_names(delta) if self.tokens_as_ids else delta
                if delta.finished:
                    self._done = True
                    return
        except (ApiError, _Retryable, asyncio.CancelledError):
            raise
        except Exception as err:  # the replica's process died under the call
            if self._may_retry(ENGINE_UNAVAILABLE):
                raise _Retryable() from err
            raise

    async def _fed(self) -> AsyncIterator[GenerateDelta]:
        while True:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self._done = True
                raise item
            yield item

    def close(self) -> None:
        if self._call is not None and not self._done:
            self._call.cancel()
        self._done = True
        if self._queue is not None:
            self._feeds.unregister(self.request_id)
            self._queue = None
        if self._counted:
            self._router.on_finish(self.group)
            self._counted = False


class _GroupLost(Exception):
    """The choice's group lost its running replicas before acknowledging it (``ChoiceStream._acknowledgement``)."""


class _Retryable(Exception):
    """The choice's engine failed before its first token: send it elsewhere (``ChoiceStream._retry``)."""


async def respond(streams: list[ChoiceStream], body, chat: bool, model: str, router: GroupRouter,
                  make_parser: Callable[[], ToolCallParser] | None = None, spec_metrics: bool = False):
    """``make_parser``: chat requests whose output may hold tool calls (None: plain text); ``spec_metrics``:
    the response carries vLLM's per-request ``metrics`` (streamed: in the last chunk, which then carries
    the usage too, asked for or not, as on vLLM with ``--enable-force-include-usage``)."""
    try:
        results = await asyncio.gather(*(s.start(router) for s in streams), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
    except BaseException:
        _close_all(streams)
        raise
    if body.stream:
        return ClosingStreamingResponse(_sse(streams, body, chat, model, make_parser, spec_metrics),
                                 media_type="text/event-stream")
    try:
        states = await asyncio.gather(*(_collect(s, make_parser) for s in streams))
    finally:
        _close_all(streams)
    created = int(time.time())
    usage = responses.usage(states, [s.prompt_index for s in streams])
    rid = streams[0].request_id.rsplit("-", 1)[0]
    metrics = responses.spec_decode_metrics(states) if spec_metrics else None
    if chat:
        return JSONResponse(responses.chat_body(rid, created, model, states, usage, body.num_logprobs,
                                                streams[0].echo, body.return_token_ids, metrics))
    return JSONResponse(responses.completion_body(rid, created, model, states, usage, body.logprobs is not None,
                                                  [s.echo for s in streams], body.return_token_ids, metrics))


async def _collect(stream: ChoiceStream, make_parser: Callable[[], ToolCallParser] | None) -> responses.ChoiceState:
    state = responses.ChoiceState(stream.index, prompt_token_ids=stream.prompt_token_ids)
    async for delta in stream.deltas():
        state.add(delta)
    if make_parser is not None:
        state.set_parsed(make_parser().parse(state.text))
    return state


async def _sse(streams: list[ChoiceStream], body, chat: bool, model: str,
               make_parser: Callable[[], ToolCallParser] | None, spec_metrics: bool = False) -> AsyncIterator[str]:
    created = int(time.time())
    rid = streams[0].request_id.rsplit("-", 1)[0]
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    continuous = include_usage and body.stream_options.continuous_usage_stats
    num_logprobs = body.num_logprobs if chat else None
    token_ids = body.return_token_ids
    states = [responses.ChoiceState(s.index, prompt_token_ids=s.prompt_token_ids) for s in streams]
    parsers = [make_parser() if make_parser is not None else None for _ in streams]
    for state, stream in zip(states, streams):
        state.num_prompt_tokens = len(stream.prompt_token_ids)
    queue: asyncio.Queue = asyncio.Queue()

    def usage_now(position: int) -> dict | None:
        return responses.usage([states[position]], [0]) if continuous else None

    async def pump(position: int) -> None:
        try:
            async for delta in streams[position].deltas():
                await queue.put((position, delta))
        except Exception as err:  # an engine failure mid-stream: report it in the stream
            await queue.put((position, err))
        finally:
            await queue.put((position, None))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(streams))]
    remaining = len(streams)
    try:
        if chat:  # with tools, no empty content: an output of only calls has content null, as in OpenAI
            first = {"role": "assistant"} if make_parser is not None else {"role": "assistant", "content": ""}
            for position, s in enumerate(streams):
                yield _event(responses.chat_chunk(rid, created, model, s.index, first, None, None, include_usage,
                                                  usage_now=usage_now(position),
                                                  prompt_token_ids=s.prompt_token_ids if token_ids else None))
            for position, s in enumerate(streams):  # echo: the last message's content, in a chunk of its own
                if s.echo is not None and s.echo.text:
                    yield _event(responses.chat_chunk(rid, created, model, s.index, {"content": s.echo.text}, None,
                                                      None, include_usage, usage_now=usage_now(position)))
        while remaining:
            position, item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, Exception):
                status = getattr(item, "status", 500)
                message = getattr(item, "message", str(item))
                yield _event(responses.error_body(message, "server_error" if status >= 500 else
                                                  "invalid_request_error"))
                continue
            state, index, echo = states[position], streams[position].index, streams[position].echo
            text, entries = responses.echoed_chunk(state, item, None if chat else echo)
            state.add(item)
            new_ids = token_ids and bool(item.token_ids)  # sent even without text, as vLLM does
            if not text and item.finish_reason is None and not entries and not new_ids:
                continue
            if chat:
                delta_body = _chat_delta(item, parsers[position], state)
                if not delta_body and item.finish_reason is None and not item.logprobs and not new_ids:
                    continue  # held by the tool-call parser
                yield _event(responses.chat_chunk(rid, created, model, index, delta_body, item, num_logprobs,
                                                  include_usage, made_tool_calls=bool(state.tool_calls),
                                                  usage_now=usage_now(position), token_ids=token_ids))
            else:
                # The first chunk carries the prompt's ids with return_token_ids or echo (as vLLM's).
                first_ids = not state.sent_first and (token_ids or echo is not None)
                chunk = responses.completion_chunk(rid, created, model, index, item, state.next_offset,
                                                   body.logprobs is not None, include_usage,
                                                   usage_now=usage_now(position), text=text, entries=entries,
                                                   first_token=echo.first_token if echo else "",
                                                   token_ids=token_ids,
                                                   prompt_token_ids=state.prompt_token_ids if first_ids else None)
                state.sent(chunk["choices"][0]["logprobs"])
                yield _event(chunk)
        if include_usage or spec_metrics:
            usage = responses.usage(states, [s.prompt_index for s in streams])
            obj = "chat.completion.chunk" if chat else "text_completion"
            metrics = responses.spec_decode_metrics(states) if spec_metrics else None
            yield _event(responses.usage_chunk(rid, created, model, obj, usage, metrics))
        yield "data: [DONE]\n\n"
        remaining = -1  # sent in full
    finally:
        for task in tasks:
            task.cancel()
        if remaining > 0:  # the client went away (or the response was cancelled): one line, no traceback
            logger.info("request %s: the client went away with %d of %d choices unfinished; aborted, blocks freed",
                        rid, remaining, len(streams))
        _close_all(streams)


def _chat_delta(delta: GenerateDelta, parser: ToolCallParser | None, state: responses.ChoiceState) -> dict:
    """The chunk's ``delta`` (content and/or whole tool calls); calls sent are kept in ``state``."""
    if parser is None:
        return {"content": delta.text} if delta.text else {}
    parsed = parser.feed(delta.text)
    content, calls = parsed.content, list(parsed.calls)
    if delta.finish_reason is not None:
        last = parser.finish()
        content, calls = content + last.content, calls + last.calls
    body: dict = {"content": content} if content else {}
    if calls:
        first = len(state.tool_calls)
        body["tool_calls"] = [call.delta_dict(first + k) for k, call in enumerate(calls)]
        state.tool_calls.extend(calls)
    return body


def _event(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _close_all(streams: list[ChoiceStream]) -> None:
    for stream in streams:
        stream.close()
