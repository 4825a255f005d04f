"""Replica bounds change in place: the Serve config ``tandem k8s render`` writes, deployed with
Ray's own ``serve deploy`` on a Ray cluster of its own (``ray start`` on loopback), takes a new
``max_replicas`` without restarting a replica (the same actors before and after).

The cluster is separate from the session's (which this process is connected to), so it is
driven by Ray's command-line tools, inspected from a subprocess, and stopped by killing exactly
its processes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from cluster.config import config_from_dict
from cluster.k8s.rayservice import serve_config
from tests.serve.conftest import free_port
from tests.serve.ray_clusters import ray_cluster, run_tool, wait_app_running  # noqa: F401 (a fixture)

LIST_REPLICAS = """
import json, os
from ray.util.state import list_actors
alive = list_actors(address=os.environ["RAY_DASHBOARD_ADDRESS"], filters=[("state", "=", "ALIVE")], limit=1000)
print(json.dumps(sorted((a.class_name, a.actor_id) for a in alive if a.class_name.startswith("ServeReplica:"))))
"""


def _deploy(tiny_chat_model, max_replicas: int, port: int, path: Path, env: dict) -> None:
    """Render the Serve config of a one-group cluster (through ``tandem k8s render``'s code) and deploy it."""
    data = {"model": {"model": str(tiny_chat_model), "max_model_len": 256},
            "cache": {"num_blocks": 32, "block_size": 16}, "device": {"device": "cpu", "num_threads": 1},
            "serve": {"port": port, "served_model_name": "tiny", "ingress_num_cpus": 0.1,
                      "groups": [{"name": "a", "num_cpus": 0.5,
                                  "autoscaling": {"min_replicas": 1, "max_replicas": max_replicas}}]}}
    path.write_text(yaml.safe_dump(serve_config(config_from_dict(data, "test"), data)))
    run_tool("serve", "deploy", str(path), env=env)


def test_a_new_max_replicas_keeps_every_running_replica(tiny_chat_model, ray_cluster, tmp_path):
    env = ray_cluster
    config_path, port = tmp_path / "serve.yaml", free_port()
    _deploy(tiny_chat_model, 2, port, config_path, env)
    wait_app_running(env)
    before = json.loads(run_tool("python", "-c", LIST_REPLICAS, env=env))
    assert {name for name, _ in before} >= {"ServeReplica:tandem:replica-a", "ServeReplica:tandem:ingress"}

    _deploy(tiny_chat_model, 3, port, config_path, env)
    deadline = time.time() + 120
    while True:  # Serve applies the new bounds
        deployed = yaml.safe_load(run_tool("serve", "config", env=env))
        [entry] = [d for d in deployed["deployments"] if d["name"] == "replica-a"]
        if entry["autoscaling_config"]["max_replicas"] == 3:
            break
        assert time.time() < deadline, entry
        time.sleep(2)
    wait_app_running(env)
    after = json.loads(run_tool("python", "-c", LIST_REPLICAS, env=env))
    assert after == before  # the same replica actors, none restarted
