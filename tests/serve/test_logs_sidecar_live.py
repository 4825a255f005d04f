"""What the ``ray-logs`` sidecar prints from a real cluster: ``tandem serve`` with ``log_format: json``
(Ray in a temp folder of its own), and the follower the sidecar runs reading that folder. A request
sent with ``X-Request-Id`` comes out as JSON lines that name it: Serve's access line for the call and
the engine core's lines for its engine request; nothing but JSON comes out."""

from __future__ import annotations

import json
import queue
import shutil
import subprocess
import sys
import tempfile
import threading

import httpx
import pytest

from tests.serve.conftest import MODEL, ServeProcess


def test_the_sidecar_prints_the_requests_json_lines_from_a_running_server(tiny_chat_model, tmp_path):
    ray_tmp = tempfile.mkdtemp(prefix="tl", dir="/tmp")  # Ray uses <it>/ray; its sockets need a short path
    server = ServeProcess({
        "model": {"model": str(tiny_chat_model), "max_model_len": 256},
        "cache": {"num_blocks": 64, "block_size": 16},
        "device": {"device": "cpu", "num_threads": 1},
        "serve": {"served_model_name": MODEL, "log_format": "json", "log_requests": True,
                  "direct_ingress": False,  # under direct ingress Serve writes access lines 1000 at a time
                  "groups": [{"name": "g", "num_cpus": 0.5}]}}, tmp_path, env={"RAY_TMPDIR": ray_tmp})
    follower = subprocess.Popen([sys.executable, "-m", "cluster.shared.log_follow", "--interval", "0.2",
                                 "--dir", f"{ray_tmp}/ray/session_latest/logs"], stdout=subprocess.PIPE)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in follower.stdout], daemon=True).start()
    try:
        response = httpx.post(f"{server.url}/v1/completions", timeout=60, headers={"X-Request-Id": "sidecar-77"},
                              json={"model": MODEL, "prompt": "logs", "max_tokens": 3, "temperature": 0})
        assert response.status_code == 200, response.text
        access = engine = None
        printed = 0
        while access is None or engine is None:
            try:  # a hang guard: Serve's and the engine's lines come within a second or two here
                line = lines.get(timeout=60)
            except queue.Empty:
                pytest.fail(f"the follower went quiet after {printed} lines: access line {access}, engine line "
                            f"{engine}")
            record = json.loads(line)  # every line the follower prints is JSON
            printed += 1
            if record.get("request_id") == "sidecar-77" and "POST /v1/completions 200" in record["message"]:
                access = record
            if str(record.get("request_id", "")).startswith("cmpl-sidecar-77-") and \
                    record.get("component") == "engine-core" and "finished" in record["message"]:
                engine = record
        assert access["application"] == "tandem"
    finally:
        follower.terminate()
        follower.wait(timeout=30)
        server.stop()
        shutil.rmtree(ray_tmp, ignore_errors=True)
