"""Clients that go away free their KV blocks; the router prefers the faster group."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.serve.conftest import API_KEY, MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _engines(url: str) -> dict:
    return httpx.get(f"{url}/debug/engines", headers=AUTH, timeout=30).json()


def _wait_all_free(url: str, timeout: float = 60.0) -> dict:
    deadline = time.time() + timeout
    while True:
        engines = _engines(url)
        if all(e["num_running"] == 0 and e["num_waiting"] == 0 and e["num_free_blocks"] == e["num_blocks"]
               for e in engines.values()) or time.time() > deadline:
            return engines
        time.sleep(0.2)


def test_disconnect_mid_stream_frees_every_block(server_url):
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 200, "ignore_eos": True,
            "temperature": 0, "stream": True, "n": 2}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server_url}/v1/completions", json=body, headers=AUTH) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            received = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: {") for line in received)
            busy = _engines(server_url)
            assert sum(e["num_running"] for e in busy.values()) >= 1  # still generating when we leave
    engines = _wait_all_free(server_url)
    for name, engine in engines.items():
        assert engine["num_running"] == 0 and engine["num_waiting"] == 0, (name, engine)
        assert engine["num_free_blocks"] == engine["num_blocks"], (name, engine)
        assert engine["speculation"]["method"] == "draft" and engine["speculation"]["k_table"], (name, engine)


def test_router_sends_the_larger_share_to_the_faster_group(server_url, async_client):
    async def one(i: int):
        return await async_client.completions.create(model=MODEL, prompt=f"request {i} says", max_tokens=24,
                                                     temperature=0, extra_body={"ignore_eos": True})

    async def scenario():
        for _ in range(2):  # both groups serve and publish their step times
            await asyncio.gather(*(one(i) for i in range(4)))
        middle = httpx.get(f"{server_url}/debug/router", headers=AUTH, timeout=30).json()["decisions"]
        results = await asyncio.gather(*(one(i) for i in range(24)))
        return middle, results

    middle, results = asyncio.run(scenario())
    after = httpx.get(f"{server_url}/debug/router", headers=AUTH, timeout=30).json()
    assert all(r.usage.completion_tokens == 24 for r in results)
    share = {g: after["decisions"].get(g, 0) - middle.get(g, 0) for g in ("fast", "slow")}
    assert sum(share.values()) == 24
    print("router share", share, after)
    assert share["fast"] > share["slow"], (share, after)
    speed = {r["group"]: r["speed_factor"] for r in after["replicas"].values()}
    assert set(speed) == {"fast", "slow"}
    choices = after["replica_choices"]  # the router inside each group counted its rankings too
    assert choices.get("ranked", 0) + choices.get("fallback", 0) >= 32, choices
