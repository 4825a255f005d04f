"""Tandem's capacity autoscaling policy on a local cluster: a burst that loads the one replica past
the batch size where its throughput levels off makes Ray Serve start a second one, where Ray
Serve's own policy (64 ongoing requests per replica, set here) would keep one for 16 requests."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.serve.conftest import MODEL, ServeProcess, scrape_metrics


def _replicas(url: str) -> set[str]:
    series = scrape_metrics(url).get("vllm:num_requests_running", [])
    return {s.labels["replica"] for s in series if s.labels.get("group") == "auto"}


def test_a_burst_past_the_replicas_capacity_adds_a_replica(tiny_chat_model, tmp_path):
    server = ServeProcess({
        "model": {"model": str(tiny_chat_model), "max_model_len": 256},
        "cache": {"num_blocks": 64, "block_size": 16},
        "device": {"device": "cpu", "num_threads": 1},
        "scheduler": {"max_num_seqs": 4},
        "serve": {"served_model_name": MODEL, "drain_timeout_s": 0,
                  "groups": [{"name": "auto", "num_cpus": 0.5, "step_time_scale": 40.0,
                              "autoscaling": {"min_replicas": 1, "max_replicas": 2, "policy": "capacity",
                                              "target_ongoing_requests": 64,
                                              "upscale_delay_s": 1, "downscale_delay_s": 600}}]}}, tmp_path)
    try:
        deadline = time.time() + 30
        while len(_replicas(server.url)) != 1:  # the one replica reports through /metrics
            assert time.time() < deadline
            time.sleep(1)
        body = {"model": MODEL, "prompt": "burst", "max_tokens": 200, "ignore_eos": True, "temperature": 0}

        def send(_: int) -> int:
            return httpx.post(f"{server.url}/v1/completions", json=body, timeout=300).status_code

        with ThreadPoolExecutor(16) as pool:
            # 16 requests on a replica that batches 4, for about a minute: Serve's replicas report custom
            # metrics every 10 s, and the controller averages them over the last 30 s.
            burst = [pool.submit(send, i) for i in range(16)]
            deadline = time.time() + 150
            while len(_replicas(server.url)) < 2:
                assert time.time() < deadline, "no second replica: " + server.log.read_text()[-2000:]
                time.sleep(2)
            assert [f.result() for f in burst] == [200] * 16
    finally:
        server.stop()
