"""``tandem serve`` beside another on one host, and stopping that is always bounded.

- Two servers side by side, each with its own Ray: the second leaves Ray's metrics port and
  Serve's proxy port at their defaults while something else holds the metrics port (as a first
  server with the default config would), moves them aside and says so; stopping the first
  leaves the second serving.
- With the server's raylet killed, SIGTERM still exits within ``drain_timeout_s`` plus the
  shutdown bounds (it once hung in the drain's actor lookup).
- SIGTERM while the server starts (the API up, the engine not yet) stops it drained: the
  request the API had accepted is answered (or refused with a 503), and the process exits 0.

The real command in processes of their own, serving the tiny model."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import httpx

from deployments.local import RAY_SHUTDOWN_TIMEOUT_S, SHUTDOWN_TIMEOUT_S
from tests.serve.conftest import MODEL, ServeProcess
from tests.serve.ray_clusters import command_line, with_descendants

RAY_METRICS_DEFAULT = 8080  # ServeConfig.metrics_export_port's default


def _config(tiny_chat_model, **serve) -> dict:
    return {"model": {"model": str(tiny_chat_model), "max_model_len": 512},
            "cache": {"num_blocks": 64, "block_size": 16},
            "device": {"device": "cpu", "num_threads": 1},
            "serve": {"served_model_name": MODEL, "groups": [{"name": "default", "num_cpus": 0.5}], **serve}}


def _complete(url: str, prompt: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0})


def test_two_servers_side_by_side_and_one_stops(tiny_chat_model, tmp_path):
    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", RAY_METRICS_DEFAULT))
        holder.listen()
    except OSError:  # someone else holds it already: the same situation
        holder.close()
        holder = None
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = ServeProcess(_config(tiny_chat_model), tmp_path / "a")
    second = None
    try:
        second = ServeProcess(_config(tiny_chat_model, metrics_export_port=None, proxy_port=None), tmp_path / "b")
        log = second.log.read_text()
        assert f"serve.metrics_export_port: port {RAY_METRICS_DEFAULT} is taken" in log, log[-3000:]
        for server in (first, second):
            assert _complete(server.url, "side by side").status_code == 200
        first.stop()
        assert first.process.returncode == 0, first.log.read_text()[-3000:]
        assert second.process.poll() is None
        answer = _complete(second.url, "still here")
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(f"{second.url}/metrics", timeout=30).status_code == 200
    finally:
        first.stop()
        if second is not None:
            second.stop()
        if holder is not None:
            holder.close()


def test_sigterm_exits_within_its_bounds_when_ray_is_gone(tiny_chat_model, tmp_path):
    """The raylet killed and the GCS frozen (it answers nothing, its sockets stay open: every call
    of the driver into Ray waits), then SIGTERM: the drain's and the shutdown's calls hang, and
    the process still exits once its bounds have passed."""
    drain_timeout_s = 5.0
    server = ServeProcess(_config(tiny_chat_model, drain_timeout_s=drain_timeout_s), tmp_path)
    ray_processes = {p: command_line(p).split(" ")[0] for p in with_descendants([server.process.pid])[1:]}
    raylets = [p for p, program in ray_processes.items() if program.endswith("raylet")]
    gcs = [p for p, program in ray_processes.items() if program.endswith("gcs_server")]
    assert raylets and gcs, ray_processes
    try:
        for pid in gcs:
            os.kill(pid, signal.SIGSTOP)
        for pid in raylets:
            os.kill(pid, signal.SIGKILL)
        server.process.send_signal(signal.SIGTERM)
        # A liveness bound, not a timing: the process must not hang past its own bounds (+ slack for a busy CI).
        bound = drain_timeout_s + SHUTDOWN_TIMEOUT_S + RAY_SHUTDOWN_TIMEOUT_S + 60
        server.process.wait(timeout=bound)
        assert "s (is Ray's raylet or GCS gone?): exiting" in server.log.read_text()
    finally:
        server.stop()
        for pid in gcs:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_sigterm_while_starting_stops_drained(tiny_chat_model, tmp_path):
    # Every engine step stretched: the engine answers slowly, so the request is in flight at the signal.
    config = _config(tiny_chat_model, drain_timeout_s=60)
    config["serve"]["groups"][0]["step_time_scale"] = 50.0
    server = ServeProcess(config, tmp_path, wait=False)
    answers: list[httpx.Response | Exception] = []
    try:
        deadline = time.time() + 180
        while True:  # the API answers before the server says it serves
            assert server.process.poll() is None, server.log.read_text()[-3000:]
            try:
                if httpx.get(f"{server.url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "the API never answered: " + server.log.read_text()[-3000:]
            time.sleep(0.2)
        sender = threading.Thread(target=lambda: answers.append(_try(lambda: _complete(server.url, "early"))))
        sender.start()
        time.sleep(0.5)
        server.process.send_signal(signal.SIGTERM)
        sender.join(timeout=180)
        assert server.process.wait(timeout=180) == 0, server.log.read_text()[-3000:]
    finally:
        server.stop()
    log = server.log.read_text()
    assert answers and not isinstance(answers[0], Exception), (answers, log[-3000:])
    answer = answers[0]
    if answer.status_code == 200:
        assert answer.json()["usage"]["completion_tokens"] == 4
    else:
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "shutting_down", answer.text
    assert "draining" in log, log[-3000:]


def _try(call):
    try:
        return call()
    except Exception as err:  # noqa: BLE001 (the test reports what the client got)
        return err
