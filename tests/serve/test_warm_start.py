"""A replica added to a group with suffix drafts starts with the running replica's latest responses
in its replica-wide tree (a warm start through Ray), before it has served anything.

The Serve config ``tandem k8s render`` writes, deployed with ``serve deploy`` on a Ray cluster of
the test's own: one replica answers a few requests, then the group's lower bound rises to two."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import yaml

from cluster.config import config_from_dict
from cluster.k8s.rayservice import serve_config
from tests.serve.conftest import free_port, scrape_metrics
from tests.serve.ray_clusters import ray_cluster, run_tool, wait_app_running  # noqa: F401 (a fixture)

TREE = "tandem:suffix_tree_requests"


def _deploy(tiny_chat_model, replicas: int, port: int, path: Path, env: dict) -> None:
    data = {"model": {"model": str(tiny_chat_model), "max_model_len": 256},
            "cache": {"num_blocks": 32, "block_size": 16}, "device": {"device": "cpu", "num_threads": 1},
            "speculative": {"method": "suffix", "num_speculative_tokens": 4},
            "serve": {"port": port, "served_model_name": "tiny", "ingress_num_cpus": 0.1,
                      "groups": [{"name": "a", "num_cpus": 0.5,
                                  "autoscaling": {"min_replicas": replicas, "max_replicas": 2}}]}}
    path.write_text(yaml.safe_dump(serve_config(config_from_dict(data, "test"), data)))
    run_tool("serve", "deploy", str(path), env=env)


def _trees(port: int) -> dict[str, float]:
    """Responses in each replica's replica-wide tree, by replica."""
    return {s.labels.get("replica", ""): s.value for s in scrape_metrics(f"http://127.0.0.1:{port}").get(TREE, [])}


def test_a_replica_added_to_the_group_drafts_from_the_running_ones_responses(tiny_chat_model, ray_cluster,
                                                                             tmp_path):
    env = ray_cluster
    config_path, port = tmp_path / "serve.yaml", free_port()
    _deploy(tiny_chat_model, 1, port, config_path, env)
    wait_app_running(env)
    for i in range(3):
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                           json={"model": "tiny", "prompt": f"warm start {i}", "max_tokens": 8, "temperature": 0,
                                 "ignore_eos": True})
        assert reply.status_code == 200, reply.text
    deadline = time.time() + 60
    while not (trees := _trees(port)):  # replicas report their metrics every few seconds
        assert time.time() < deadline, sorted(scrape_metrics(f"http://127.0.0.1:{port}"))
        time.sleep(1)
    [first] = trees

    _deploy(tiny_chat_model, 2, port, config_path, env)
    deadline = time.time() + 180
    while True:  # the second replica starts, asks the first, and seeds its tree
        trees = _trees(port)
        added = {replica: n for replica, n in trees.items() if replica != first}
        if added and max(added.values()) >= 3:
            break
        assert time.time() < deadline, trees
        time.sleep(2)
    assert trees[first] == 3  # the first kept its own three, and gave copies
