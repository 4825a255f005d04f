"""An ingress replica whose process dies is replaced on the same port: under direct ingress
the ingress answers HTTP on ``serve.port`` itself, so clients lose what was in flight on it,
not the service (its replacement binds over the dead one's lingering connections, and Serve
gives the released port back at once)."""

from __future__ import annotations

import time

import httpx

from tests.serve.conftest import API_KEY, MODEL

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def _ingress_actor():
    import ray

    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if "#ingress#" in a["name"]]
    assert len(names) == 1, names
    return ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])


def _models(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/v1/models", headers=HEADERS, timeout=5).status_code
    except httpx.HTTPError:
        return None


def test_a_killed_ingress_is_replaced_on_the_same_port(server_url, client):
    import ray

    before = _ingress_actor()
    with httpx.Client(timeout=30) as http:  # a kept-alive connection: it lingers on the port after the kill
        assert http.get(f"{server_url}/v1/models", headers=HEADERS).status_code == 200
        ray.kill(before, no_restart=True)
        deadline = time.monotonic() + 30
        while _models(server_url) == 200:  # until the dead ingress stops answering
            assert time.monotonic() < deadline, "the killed ingress still answers"
            time.sleep(0.1)
    deadline = time.monotonic() + 120
    while _models(server_url) != 200:
        assert time.monotonic() < deadline, f"nothing answers at {server_url} after the ingress was replaced"
        time.sleep(0.5)
    assert _ingress_actor()._actor_id != before._actor_id
    done = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0)
    assert done.usage.completion_tokens == 4
