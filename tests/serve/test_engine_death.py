"""An engine-core process that dies under a running cluster: its streams end with a
server error within seconds, the replica fails its health check (and ``GET /health``
answers 503 naming its group while it has no running replica), and Serve replaces it with
a working one."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx

from tests.serve.conftest import API_KEY, MODEL

HEADERS = {"Authorization": f"Bearer {API_KEY}", "X-Tandem-Group": "slow"}


def _slow_engine(url: str) -> dict:
    return httpx.get(f"{url}/debug/engines", headers=HEADERS, timeout=30).json()["slow"]


def test_a_killed_engine_core_fails_its_streams_and_serve_replaces_the_replica(server_url):
    before = _slow_engine(server_url)
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 200, "ignore_eos": True,
            "temperature": 0, "stream": True}
    events = []
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server_url}/v1/completions", json=body, headers=HEADERS) as response:
            assert response.status_code == 200
            lines = (line for line in response.iter_lines() if line.startswith("data: "))
            events.append(next(lines))
            os.kill(before["engine_pid"], signal.SIGKILL)
            killed = time.monotonic()
            for line in lines:
                events.append(line)
            ended = time.monotonic() - killed
    errors = [json.loads(e[6:]) for e in events if e.startswith("data: {") and '"error"' in e]
    assert errors, events[-3:]
    assert errors[0]["error"]["type"] == "server_error" and "engine process exited" in errors[0]["error"]["message"]
    assert ended < 10
    # Serve sees the failed health check (every 5 s) and starts a new replica with a new core;
    # until that one runs, the group has no running replica and /health says so. (Poll /health
    # alone here: a call routed to the group would wait for the new replica.)
    deadline = time.monotonic() + 120
    while (health := httpx.get(f"{server_url}/health", timeout=30)).status_code != 503:
        assert health.status_code == 200, health.text
        assert time.monotonic() < deadline, "GET /health never reported the group without a running replica"
        time.sleep(0.2)
    assert health.json()["status"] == "unavailable" and list(health.json()["groups"]) == ["slow"]
    deadline = time.monotonic() + 180
    while True:
        try:
            after = _slow_engine(server_url)
            if after["replica_id"] != before["replica_id"]:
                break
        except (httpx.HTTPError, KeyError, json.JSONDecodeError):
            pass
        assert time.monotonic() < deadline, "the replica with the dead engine was not replaced"
        time.sleep(1)
    assert httpx.get(f"{server_url}/health", timeout=30).status_code == 200
    assert after["engine_pid"] != before["engine_pid"]
    reply = httpx.post(f"{server_url}/v1/completions", headers=HEADERS, timeout=60,
                       json={"model": MODEL, "prompt": "again", "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
