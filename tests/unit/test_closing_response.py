"""A streamed answer whose client goes away right after ``[DONE]`` still closes its choice
streams at once: Starlette cancels the sending task on the disconnect, and without the response
closing its generator the router would count the call in flight until a garbage collection
(a drain then waits out its whole bound; Ray Serve freezes the collector)."""

from __future__ import annotations

import asyncio
import gc

from cluster.api.openai_protocol import CompletionRequest
from cluster.hosting.protocol import GenerateRequest
from cluster.routing.group_router import GroupRouter
from cluster.routing.stats import RoutingRequest
from cluster.shared.sampling_params import SamplingParams
from deployments import streams
from deployments.streams import ChoiceStream
from tests.unit.test_delta_feeds import _Backend, _Handle, _replica


def _asgi_call(response):
    """Run ``response`` as an ASGI 2.3 server would (Starlette listens for the disconnect beside
    the sending); the client disconnects while the server is still sending ``[DONE]``. Returns the
    body received."""
    received: list[bytes] = []
    sent_done = asyncio.Event()

    async def send(message):
        if message["type"] == "http.response.body":
            received.append(message.get("body", b""))
            if b"[DONE]" in message.get("body", b""):
                sent_done.set()
                await asyncio.sleep(0.2)  # the socket write still under way when the client leaves

    async def receive():
        await sent_done.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
    return response(scope, receive, send), received


def test_a_client_gone_right_after_done_leaves_nothing_in_flight():
    gc.disable()  # as Ray Serve's frozen collector: only the response itself may close the generator
    try:
        async def scenario():
            router = GroupRouter({"g": 1}, policy="pow2", seed=0)
            handle = _Handle(_replica(_Backend()))
            request = GenerateRequest("cmpl-x-0", [1, 2], SamplingParams(max_tokens=5),
                                      routing=RoutingRequest(num_prompt_tokens=2, expected_output_tokens=5))
            body = CompletionRequest(model="m", prompt="hi", stream=True)
            response = await streams.respond([ChoiceStream(0, 0, {"g": request}, {"g": handle})], body, False, "m",
                                             router)
            assert sum(router.inflight.values()) == 1
            call, received = _asgi_call(response)
            await call
            # Asked while the response still exists (its end would let asyncio close the generator).
            return sum(router.inflight.values()), b"".join(received), response

        in_flight, body, _ = asyncio.run(scenario())
        assert b"data: [DONE]" in body  # the whole answer went out
        assert in_flight == 0  # and the call was counted out with no collection
    finally:
        gc.enable()
