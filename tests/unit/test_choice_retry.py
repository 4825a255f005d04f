"""A choice whose engine is gone or failed before its first token reached the client is sent once
more, elsewhere; one that already streamed, or that the engine refused for its own fault, is not.
Without Ray: the replicas' logic behind the stand-in handles of ``test_delta_feeds``."""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster.hosting.protocol import ENGINE_UNAVAILABLE, ErrorInfo, GenerateDelta, GenerateRequest
from cluster.routing.group_router import GroupRouter
from cluster.routing.stats import RoutingRequest
from cluster.shared.sampling_params import SamplingParams
from deployments.feeds import DeltaFeeds
from deployments import streams
from deployments.streams import ApiError, ChoiceStream
from tests.unit.test_delta_feeds import _Backend, _collect, _Handle, _replica

GONE = ErrorInfo(503, "the engine process exited with -9; the replica is being replaced, retry", "server_error",
                 code=ENGINE_UNAVAILABLE)


class _DeadEngine(_Backend):
    """An engine that is gone: refuses at once (``at_ack``) or after acknowledging, after ``tokens`` tokens."""

    def __init__(self, at_ack: bool, tokens: int = 0) -> None:
        super().__init__()
        self.at_ack, self.tokens, self.calls = at_ack, tokens, 0

    async def generate(self, request: GenerateRequest):
        self.calls += 1
        if self.at_ack:
            yield GenerateDelta(error=GONE)
            return
        yield GenerateDelta(accepted=True)
        for i in range(self.tokens):
            yield GenerateDelta(text=f"t{i} ", token_ids=[i], num_output_tokens=i + 1)
        yield GenerateDelta(error=GONE)


def _choice(i: int, handles: dict[str, _Handle], feeds: DeltaFeeds | None) -> ChoiceStream:
    requests = {group: GenerateRequest(f"req-{i}", [1, 2], SamplingParams(max_tokens=5),
                                       routing=RoutingRequest(num_prompt_tokens=2, expected_output_tokens=5))
                for group in handles}
    return ChoiceStream(i, 0, requests, handles, feeds=feeds)


async def _serve(dead: _Backend, n: int = 8, feeds: bool = False):
    """``n`` choices that may go to group a (``dead``) or b (a working engine): their outputs or errors,
    and the router."""
    handles = {"a": _Handle(_replica(dead, "dead")), "b": _Handle(_replica(_Backend(), "alive"))}
    router, delta_feeds = GroupRouter({"a": 1, "b": 1}, policy="pow2", seed=0), DeltaFeeds() if feeds else None
    results = []
    for i in range(n):
        choice = _choice(i, handles, delta_feeds)
        try:
            await choice.start(router)
            results.append([t for d in await _collect(choice) for t in d.token_ids])
        except ApiError as err:
            results.append(err)
        finally:
            choice.close()
    assert sum(router.inflight.values()) == 0  # every send and resend was counted out
    return results, router


@pytest.mark.parametrize("at_ack", [True, False])
@pytest.mark.parametrize("feeds", [False, True])
def test_a_choice_whose_engine_died_before_its_first_token_is_answered_by_another(at_ack, feeds):
    dead = _DeadEngine(at_ack)
    results, router = asyncio.run(_serve(dead, feeds=feeds))
    assert dead.calls > 0  # the router sent some to the dead engine
    assert results == [[0, 1, 2, 3, 4]] * len(results)  # and every client got the other's whole answer
    assert router.retries == {"a": dead.calls} and router.snapshot()["retries"] == {"a": dead.calls}


def test_a_choice_that_already_streamed_is_not_sent_again():
    dead = _DeadEngine(at_ack=False, tokens=2)
    results, router = asyncio.run(_serve(dead))
    failed = [r for r in results if isinstance(r, ApiError)]
    assert dead.calls == len(failed) > 0  # each call to the dead engine ended in the client's error
    assert not router.retries
    assert all(e.status == 503 and e.code == ENGINE_UNAVAILABLE for e in failed)


def test_a_request_refused_for_its_own_fault_or_failing_twice_is_not_resent():
    async def scenario():
        refusing = _Backend()
        handles = {"a": _Handle(_replica(refusing, "r"))}
        bad = ChoiceStream(0, 0, {"a": GenerateRequest("bad", [0], SamplingParams(max_tokens=5), routing=RoutingRequest(
            num_prompt_tokens=1, expected_output_tokens=5))}, handles)
        with pytest.raises(ApiError) as err:
            await bad.start(GroupRouter({"a": 1}))
        assert err.value.status == 400 and not bad._retried
        dead = _DeadEngine(at_ack=True)
        only = _choice(1, {"a": _Handle(_replica(dead, "d"))}, None)  # no other replica or group
        with pytest.raises(ApiError) as err:
            await only.start(GroupRouter({"a": 1}))
        assert err.value.code == ENGINE_UNAVAILABLE and dead.calls == 2  # sent once more, then the error

    asyncio.run(scenario())


class _Queued(_Backend):
    """A group whose replica is gone for good: Serve holds the call, which never acknowledges."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def generate(self, request: GenerateRequest):
        self.calls += 1
        await asyncio.Event().wait()
        yield GenerateDelta(accepted=True)


def test_a_call_held_for_a_group_that_lost_its_replicas_goes_to_another_group(monkeypatch):
    monkeypatch.setattr(streams, "ACK_CHECK_SECONDS", 0.01)

    async def scenario():
        held = _Queued()
        handles = {"a": _Handle(_replica(held, "lost")), "b": _Handle(_replica(_Backend(), "alive"))}
        router = GroupRouter({"a": 1, "b": 1}, policy="pow2", seed=0)
        choice = _choice(0, handles, None)
        router.choose = lambda requests, now: router._decide("a")  # the router still ranks a first
        starting = asyncio.create_task(choice.start(router))
        while held.calls == 0:  # until the call reaches a's replica, which never acknowledges it
            await asyncio.sleep(0.01)
        assert not starting.done() and held.calls == 1
        del router.choose
        router.set_unavailable({"a"}, as_of=time.time())  # Serve's view: a has no running replica; b has one
        await starting
        tokens = [t for d in await _collect(choice) for t in d.token_ids]
        choice.close()
        assert tokens == [0, 1, 2, 3, 4] and choice.group == "b" and router.retries == {"a": 1}
        assert sum(router.inflight.values()) == 0

        only = _choice(1, {"a": _Handle(_replica(held, "lost"))}, None)  # no other group: it keeps waiting
        solo = GroupRouter({"a": 1})
        solo.set_unavailable({"a"}, as_of=time.time())
        answers = []  # each check the waiting call makes for a lost group, and the router's answer
        may_leave = solo.may_leave
        solo.may_leave = lambda group, groups: answers.append(may_leave(group, groups)) or answers[-1]
        waiting = asyncio.create_task(only.start(solo))
        while len(answers) < 5:  # several checks, not a fixed wait
            await asyncio.sleep(0.01)
        assert answers == [False] * len(answers) and held.calls == 2
        assert not waiting.done() and not solo.retries
        waiting.cancel()
        only.close()

    asyncio.run(scenario())
