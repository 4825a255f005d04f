"""Delta feeds without Ray: a replica's requests that name a feed answer only their acknowledgement
on their own call and their tokens come by the feed (``TandemReplica.feed``, ``FeedOutbox``), which the
ingress reads once per replica (``DeltaFeeds``) and hands to each ``ChoiceStream``. Serve's handle is
replaced by a stand-in that runs each call as a task, as a replica runs it (cancelling a call cancels it)."""

from __future__ import annotations

import asyncio

import pytest

from cluster.hosting.feed_outbox import FeedOutbox
from cluster.hosting.protocol import ErrorInfo, FeedRequest, GenerateDelta, GenerateRequest
from cluster.routing.group_router import GroupRouter
from cluster.routing.stats import EngineLoad, RoutingRequest
from cluster.shared.sampling_params import SamplingParams
from deployments.feeds import DeltaFeeds, FeedLostError
from deployments.replica import TandemReplica
from deployments.streams import ChoiceStream


def _token(i: int, last: bool = False) -> GenerateDelta:
    return GenerateDelta(text=f"t{i} ", token_ids=[i], num_output_tokens=i + 1,
                         finish_reason="length" if last else None)


def test_the_outbox_merges_what_waits_and_ends_idle_only_with_nothing_in_flight():
    async def scenario():
        outbox = FeedOutbox()
        outbox.put("a", _token(0))
        outbox.put("b", _token(0))
        outbox.put("a", _token(1, last=True))
        items = await outbox.take(idle_seconds=1.0)
        assert [rid for rid, _ in items] == ["a", "b"]
        assert items[0][1].token_ids == [0, 1] and items[0][1].text == "t0 t1 " and items[0][1].finished
        assert await outbox.take(idle_seconds=0.01) is None and outbox.idle
        outbox.live = 1  # a request in flight: the feed waits for it past the idle time
        asyncio.get_running_loop().call_later(0.05, outbox.put, "c", _token(0))
        assert [rid for rid, _ in await outbox.take(idle_seconds=0.01)] == ["c"]
        outbox.put("d", _token(0))
        outbox.drop("d")
        outbox.live = 0
        assert await outbox.take(idle_seconds=0.01) is None

    asyncio.run(scenario())


class _Backend:
    """Acknowledges, then one token per tick; ``fail_after`` ends a request with an engine error."""

    def __init__(self, num_tokens: int = 5) -> None:
        self.num_tokens = num_tokens
        self.aborted: list[str] = []

    async def generate(self, request: GenerateRequest):
        if request.prompt_token_ids == [0]:
            yield GenerateDelta(error=_error("the prompt is empty"))
            return
        yield GenerateDelta(accepted=True)
        try:
            for i in range(self.num_tokens):
                await asyncio.sleep(0.001)
                yield _token(i, last=i == self.num_tokens - 1)
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(request.request_id)
            raise

    def load(self, prefix_depth: int) -> EngineLoad:
        return EngineLoad(num_running=0, num_waiting=0, max_num_seqs=8, kv_cache_usage=0.0, current_k=0,
                          acceptance=0.0)


def _error(message: str) -> ErrorInfo:
    return ErrorInfo(400, message, param="prompt")


class _ReplicaLogic(TandemReplica):
    """The replica's logic without Serve or an engine (nothing to shut down)."""

    def __del__(self) -> None:
        pass


def _replica(backend: _Backend, replica_id: str = "r1") -> TandemReplica:
    replica = object.__new__(_ReplicaLogic)
    replica.backend, replica.replica_id, replica.prefix_depth, replica._outboxes = backend, replica_id, 0, {}
    replica.group = type("Group", (), {"name": "g", "device_kind": "cpu"})()
    return replica


class _Call:
    """A streamed call as Serve runs it: a task on the replica's side; cancel() cancels it."""

    def __init__(self, stream) -> None:
        self._items: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._run(stream))

    async def _run(self, stream) -> None:
        try:
            async for item in stream:
                self._items.put_nowait(item)
            self._items.put_nowait(StopAsyncIteration())
        except asyncio.CancelledError:
            self._items.put_nowait(RuntimeError("the call was cancelled"))
            raise
        except Exception as err:
            self._items.put_nowait(err)

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self._items.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self._task.cancel()


class _Handle:
    def __init__(self, replica: TandemReplica) -> None:
        self.replica = replica
        self.feed_calls = 0

    def options(self, stream: bool):
        return self

    @property
    def generate(self):
        return type("Method", (), {"remote": staticmethod(lambda request: _Call(self.replica.generate(request)))})

    @property
    def feed(self):
        def remote(subscription: FeedRequest):
            self.feed_calls += 1
            return _Call(self.replica.feed(subscription))
        return type("Method", (), {"remote": staticmethod(remote)})


def _stream(i: int, handle: _Handle, feeds: DeltaFeeds | None, prompt: list[int] = (1, 2)) -> ChoiceStream:
    request = GenerateRequest(f"req-{i}", list(prompt), SamplingParams(max_tokens=5),
                              routing=RoutingRequest(num_prompt_tokens=len(prompt), expected_output_tokens=5))
    return ChoiceStream(i, 0, {"g": request}, {"g": handle}, feeds=feeds)


async def _collect(stream: ChoiceStream) -> list[GenerateDelta]:
    return [delta async for delta in stream.deltas()]


@pytest.mark.parametrize("with_feeds", [True, False])
def test_choices_get_every_token_by_the_feed_as_by_their_own_streams(with_feeds):
    async def scenario():
        backend = _Backend()
        replica = _replica(backend)
        handle = _Handle(replica)
        feeds = DeltaFeeds() if with_feeds else None
        router = GroupRouter({"g": 1})
        streams = [_stream(i, handle, feeds) for i in range(6)]
        await asyncio.gather(*(s.start(router) for s in streams))
        outputs = await asyncio.gather(*(_collect(s) for s in streams))
        for s in streams:
            s.close()
        for deltas in outputs:  # deltas that waited together arrive merged: the tokens are what counts
            assert [t for d in deltas for t in d.token_ids] == list(range(5)) and deltas[-1].finish_reason
        await asyncio.sleep(0.01)  # the calls end after their last token
        assert handle.feed_calls == (1 if with_feeds else 0)  # one feed for all six requests
        assert all(o.live == 0 for o in replica._outboxes.values())
        if feeds is not None:
            assert feeds._queues == {} and feeds._waiting == {}

    asyncio.run(scenario())


def test_a_refused_request_is_answered_on_its_call_and_a_closed_one_aborts_and_leaves_nothing():
    async def scenario():
        backend = _Backend(num_tokens=1000)
        replica = _replica(backend)
        handle = _Handle(replica)
        feeds, router = DeltaFeeds(), GroupRouter({"g": 1})
        refused = _stream(0, handle, feeds, prompt=[0])
        with pytest.raises(Exception) as err:
            await refused.start(router)
        assert err.value.status == 400
        refused.close()
        closed = _stream(1, handle, feeds)
        await closed.start(router)
        async for delta in closed.deltas():
            break  # the client goes away after its first token
        closed.close()
        for _ in range(100):
            if backend.aborted and not replica._outboxes:
                break
            await asyncio.sleep(0.01)
        assert backend.aborted == ["req-1"]
        assert feeds._queues == {} and feeds._waiting == {}
        await asyncio.sleep(0.05)
        assert all(o.live == 0 for o in replica._outboxes.values())

    asyncio.run(scenario())


def test_a_feed_that_fails_fails_its_requests_with_a_503():
    async def scenario():
        replica = _replica(_Backend(num_tokens=1000))
        handle = _Handle(replica)
        feeds, router = DeltaFeeds(), GroupRouter({"g": 1})

        async def broken(subscription):
            raise RuntimeError("the replica's actor died")
            yield  # an async generator

        replica.feed = broken
        stream = _stream(0, handle, feeds)
        await stream.start(router)
        with pytest.raises(FeedLostError) as err:
            await _collect(stream)
        assert err.value.status == 503 and "r1" in err.value.message
        stream.close()

    asyncio.run(scenario())


def test_a_feed_routed_to_another_replica_ends_at_once():
    async def scenario():
        replica = _replica(_Backend(), replica_id="r2")
        items = [item async for item in replica.feed(FeedRequest("f", "r1"))]
        assert items == [] and replica._outboxes == {}

    asyncio.run(scenario())
