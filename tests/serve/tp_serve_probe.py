"""Run in a fresh interpreter by ``test_tensor_parallel_serve``: serve a tiny model in one
replica group with ``tensor_parallel_size`` 2 on its own local Ray, complete a prompt,
kill the rank-1 actor, complete again, and write what happened as JSON.

``python -m tests.serve.tp_serve_probe MODEL_DIR OUT_JSON``
"""

from __future__ import annotations

import json
import socket
import sys
import time

PROMPT = [5, 6, 7, 8, 9, 10]
MAX_TOKENS = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _deployment_status(serve, app: str, deployment: str) -> str:
    return str(serve.status().applications[app].deployments[deployment].status)


def main(model: str, out_path: str) -> None:
    import httpx
    import ray
    from ray import serve

    from cluster.config import config_from_dict
    from deployments.local import start_local
    from deployments.tp_ranks import RANK_NAME_PREFIX

    config = config_from_dict({
        "model": {"model": model, "max_model_len": 128},
        "cache": {"num_blocks": 32, "block_size": 8},
        "device": {"device": "cpu", "num_threads": 1},
        "parallel": {"collective_timeout_s": 20},
        "speculative": {"method": "draft", "draft_model": model, "num_speculative_tokens": 2},
        # The proxy gets a port of its own: its default, port + 1, may be some other socket's already.
        "serve": {"port": _free_port(), "proxy_port": _free_port(), "metrics_export_port": _free_port(),
                  "served_model_name": "m",
                  "groups": [{"name": "tp", "num_cpus": 0.5, "tensor_parallel_size": 2}]},
    })
    facts: dict = {}
    url = start_local(config, app_name="tp-probe", blocking=False)
    body = {"model": "m", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    try:
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        facts["first"] = {"status": reply.status_code, "body": reply.json()}
        ranks = [a for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith(RANK_NAME_PREFIX)]
        facts["rank_actors"] = [a["name"] for a in ranks]
        facts["status_before"] = _deployment_status(serve, "tp-probe", "replica-tp")
        ray.kill(ray.get_actor(ranks[0]["name"], namespace=ranks[0]["namespace"]))
        time.sleep(1.0)
        # A hang would end in the client's timeout (an exception, no facts): an answer is the check.
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        facts["after_kill"] = {"status": reply.status_code, "body": reply.json()}
        deadline = time.monotonic() + 60
        status = facts["status_before"]
        while time.monotonic() < deadline and status == facts["status_before"]:
            time.sleep(1.0)
            status = _deployment_status(serve, "tp-probe", "replica-tp")
        facts["status_after"] = status
    finally:
        with open(out_path, "w") as f:
            json.dump(facts, f)
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
