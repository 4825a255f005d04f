"""SIGTERM drains ``tandem serve``: a stream in flight gets every token, a request sent while
draining gets a 503, ``/health`` says draining, and the process then exits by itself.

The real command in a process of its own (its own Ray), serving the tiny model with every
engine step stretched so that 96 tokens take seconds."""

from __future__ import annotations

import json
import signal
import time

import httpx

from tests.serve.conftest import MODEL, ServeProcess


def test_sigterm_lets_the_stream_in_flight_finish(tiny_chat_model, tmp_path):
    # Every step is stretched 150x, so a loaded machine stretches the stream as much (about 30 s
    # idle, over 60 s beside one busy core): the drain's bound is far above that, and the drain
    # ends as soon as the stream does.
    server = ServeProcess({
        "model": {"model": str(tiny_chat_model), "max_model_len": 512},
        "cache": {"num_blocks": 64, "block_size": 16},
        "device": {"device": "cpu", "num_threads": 1},
        "serve": {"served_model_name": MODEL, "drain_timeout_s": 300,
                  "groups": [{"name": "slow", "num_cpus": 0.5, "step_time_scale": 150.0}]}}, tmp_path)
    proc, url, log = server.process, server.url, server.log
    try:
        body = {"model": MODEL, "prompt": "drain", "max_tokens": 96, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        usage, done, signalled, refused, health = None, False, None, None, None
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if signalled is None:
                    proc.send_signal(signal.SIGTERM)
                    signalled = time.time()
                elif refused is None:  # the ingress hears of the drain at its next report to the hub
                    health = httpx.get(f"{url}/health", timeout=30)
                    if health.status_code == 503:
                        refused = httpx.post(f"{url}/v1/completions", timeout=30, json={
                            "model": MODEL, "prompt": "late", "max_tokens": 4})
        assert done and usage is not None and usage["completion_tokens"] == 96, (usage, time.time() - signalled)
        assert refused is not None, "the stream ended before the ingress said it was draining"
        assert refused.status_code == 503, log.read_text()[-4000:]
        assert refused.json()["error"]["code"] == "shutting_down"
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        assert proc.wait(timeout=120) == 0, log.read_text()[-4000:]
        text = log.read_text()
        assert "drained: no request in flight" in text, text[-4000:]
    finally:
        server.stop()
