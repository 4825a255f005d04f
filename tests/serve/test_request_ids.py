"""A request's id: the client's ``X-Request-Id`` (or the one Ray Serve makes) comes back in the
response's header, names the response and its engine requests, and is in the engine core's log
lines (``serve.log_requests``, on in this cluster). Serve's own access line carries it too, but
under direct ingress Serve writes those in batches of 1000, so it is not waited for here."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from tests.serve.conftest import API_KEY, MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}"}
BODY = {"model": MODEL, "prompt": "ids", "max_tokens": 3, "temperature": 0}


def test_the_clients_request_id_names_the_response_and_the_engines_log_lines(server_url):
    response = httpx.post(f"{server_url}/v1/completions", json=BODY, timeout=60,
                          headers=AUTH | {"X-Request-Id": "trace-4242"})
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == "trace-4242"
    assert response.json()["id"].startswith("cmpl-trace-4242-")

    unnamed = httpx.post(f"{server_url}/v1/completions", json=BODY, headers=AUTH, timeout=60)
    made = unnamed.headers["x-request-id"]  # Serve made one
    assert made and made in unnamed.json()["id"]

    odd = httpx.post(f"{server_url}/v1/completions", json=BODY, timeout=60,
                     headers=AUTH | {"X-Request-Id": ("no spaces allowed " * 20).strip()})
    assert odd.status_code == 200 and "spaces" not in odd.json()["id"]  # unfit for an engine id: a fresh one

    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    deadline = time.time() + 30
    while not any("request cmpl-trace-4242-" in p.read_text(errors="replace") for p in logs.glob("worker-*")):
        assert time.time() < deadline, f"no engine core log line names the request under {logs}"
        time.sleep(1)
