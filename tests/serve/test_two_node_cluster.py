"""A heterogeneous cluster for real: two Ray nodes on loopback (`ray start --head`, `ray start
--address`), each advertising the accelerator type of one replica group, the application
deployed onto it with `serve deploy`, and the fast group's node (the worker) killed mid-traffic.

The groups run the same tiny model on the same CPU; the ``slow`` group stretches every
engine step 3x (``step_time_scale``), as a slower GPU kind would. The test owns its cluster:
it starts both nodes with their own ports and kills exactly the processes of that cluster
(never `ray stop`, which would also take the session's other Ray cluster down).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from cluster.models.tiny import TINY_CHAT_TEMPLATE, save_tiny_model, save_tiny_tokenizer, tiny_llama_config
from tests.serve.ray_clusters import CURRENT_CLUSTER, cluster_pids, command_line, kill, restore, with_descendants

BIN = Path(sys.executable).parent
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
MODEL = "tiny-two-node"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = tmp_path_factory.mktemp("two_node_model")
    save_tiny_model(tiny_llama_config(), model, seed=0)
    save_tiny_tokenizer(model, chat_template=TINY_CHAT_TEMPLATE)
    gcs_port, dashboard_port, http_port = _free_port(), _free_port(), _free_port()
    start = [str(BIN / "ray"), "start", "--num-cpus=1", "--disable-usage-stats"]
    saved = CURRENT_CLUSTER.read_bytes() if CURRENT_CLUSTER.exists() else None
    try:
        subprocess.run([*start, "--head", f"--port={gcs_port}", f"--dashboard-port={dashboard_port}",
                        "--resources", '{"accelerator_type:SLOW": 1}'], env=ENV, check=True, timeout=120,
                       capture_output=True)
        restore(saved)
        head_ip = socket.gethostbyname(socket.gethostname())
        subprocess.run([*start, f"--address={head_ip}:{gcs_port}", "--resources", '{"accelerator_type:FAST": 1}'],
                       env=ENV, check=True, timeout=120, capture_output=True)
        config = {"model": {"model": str(model), "max_model_len": 256}, "cache": {"num_blocks": 64, "block_size": 16},
                  "device": {"device": "cpu", "num_threads": 1},
                  "serve": {"port": http_port, "served_model_name": MODEL, "direct_ingress": False,
                            "ingress_num_cpus": 0.25,
                            "groups": [{"name": "fast", "accelerator_type": "FAST", "num_cpus": 0.5},
                                       {"name": "slow", "accelerator_type": "SLOW", "num_cpus": 0.5,
                                        "step_time_scale": 3.0}]}}
        serve_file = tmp_path_factory.mktemp("two_node_serve") / "serve.yaml"
        serve_file.write_text(yaml.safe_dump({
            "proxy_location": "EveryNode", "http_options": {"host": "127.0.0.1", "port": http_port},
            "applications": [{"name": "tandem", "route_prefix": "/", "import_path": "deployments.app:app_builder",
                              "args": {"config": config}}]}))
        subprocess.run([str(BIN / "serve"), "deploy", str(serve_file), "--address",
                        f"http://127.0.0.1:{dashboard_port}"], env=ENV, check=True, timeout=120, capture_output=True)
        url = f"http://127.0.0.1:{http_port}"
        deadline = time.time() + 240
        while time.time() < deadline:
            try:
                if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200 and _complete(url).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        else:
            pytest.fail("the application did not serve within 240 s")
        yield url, gcs_port
    finally:
        kill(with_descendants(cluster_pids(gcs_port)))
        restore(saved)


def _complete(url: str, group: str | None = None, max_tokens: int = 12) -> httpx.Response:
    headers = {"X-Tandem-Group": group} if group else {}
    return httpx.post(f"{url}/v1/completions", headers=headers, timeout=60,
                      json={"model": MODEL, "prompt": "two nodes", "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True})


def test_each_group_runs_on_its_node_and_the_faster_group_takes_more(cluster):
    url, gcs_port = cluster
    for group in ("fast", "slow"):  # both groups answer (pinned), each on the node of its kind
        assert _complete(url, group).status_code == 200
        node = with_descendants(cluster_pids(gcs_port, f"accelerator_type:{group.upper()}"))
        titles = [command_line(pid) for pid in node]
        assert any(f"replica-{group}" in t for t in titles), f"no {group} replica under the {group.upper()} node"
        assert not any(f"replica-{other}" in t for t in titles for other in ("fast", "slow") if other != group)
    before = httpx.get(f"{url}/debug/router", timeout=30).json()["decisions"]
    with ThreadPoolExecutor(8) as pool:
        statuses = [r.status_code for r in pool.map(lambda _: _complete(url, max_tokens=24), range(48))]
    assert statuses == [200] * 48
    router = httpx.get(f"{url}/debug/router", timeout=30).json()
    after = router["decisions"]
    fast, slow = (after.get(g, 0) - before.get(g, 0) for g in ("fast", "slow"))
    assert fast + slow == 48 and fast > slow, (fast, slow, router)


def test_a_node_stopped_mid_traffic_fails_its_streams_fast_and_requests_not_started_go_to_the_other_group(cluster):
    url, gcs_port = cluster
    fast_raylet = cluster_pids(gcs_port, "accelerator_type:FAST")
    assert fast_raylet, "no raylet advertises the FAST accelerator type"
    node = with_descendants(fast_raylet)  # the raylet, its workers (the fast replica) and their engine cores
    assert len(node) > 2

    started = [threading.Event() for _ in range(3)]

    def stream(index: int) -> object:
        """A long streamed completion on the fast group: its status, or the error that ended it."""
        body = {"model": MODEL, "prompt": "two nodes", "max_tokens": 220, "temperature": 0, "ignore_eos": True,
                "stream": True}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=90,
                              headers={"X-Tandem-Group": "fast"}) as response:
                lines = response.iter_lines()
                for line in lines:
                    if line.startswith("data:"):
                        started[index].set()
                        break
                text = "".join(lines)
            if "[DONE]" not in text:
                return "cut"
            return "error event" if '"error"' in text else response.status_code
        except httpx.HTTPError as err:  # the connection dropped: a fast failure too
            started[index].set()
            return type(err).__name__

    with ThreadPoolExecutor(3) as pool:
        in_flight = [pool.submit(stream, i) for i in range(3)]
        assert all(event.wait(60) for event in started)
        kill(node)
        # Every stream ends rather than hangs: result() raises past the bound.
        outcomes = [future.result(timeout=90) for future in in_flight]
    # Each stream was under way at the kill; it either still finished or ended with an error
    # (an SSE error event or a cut connection), never hanging.
    assert all(o == 200 or o == "cut" or isinstance(o, str) for o in outcomes), outcomes

    # Unpinned requests: the router still ranks the dead node's fast replica first (its last stats
    # are fresh), so it sends them there; each fails before its first token and is sent once more,
    # to the slow group. No client sees an error.
    before = httpx.get(f"{url}/debug/router", timeout=30).json()
    with ThreadPoolExecutor(4) as pool:
        statuses = [r.status_code for r in pool.map(lambda _: _complete(url), range(8))]
    assert statuses == [200] * 8, statuses
    after = httpx.get(f"{url}/debug/router", timeout=30).json()
    retried = after["retries"].get("fast", 0) - before["retries"].get("fast", 0)
    assert retried > 0, (before, after)  # the retry path ran, live
    assert _complete(url, "slow").status_code == 200
