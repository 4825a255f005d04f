"""The log follower prints each complete JSON line of Ray's Serve logs and the replicas' standard
error once, in the order read, skips text lines, waits for a line's end, and starts a replaced file
(rotated, or a new session) from its beginning."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

from cluster.shared.log_follow import LogFollower


def _append(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as file:
        file.write(text)


def _lines(out: io.BytesIO) -> list[dict]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_json_lines_are_printed_once_text_lines_skipped_and_partial_lines_awaited(tmp_path):
    out = io.BytesIO()
    follower = LogFollower(tmp_path, out)
    assert follower.poll() == 0  # nothing written yet (Ray not started)
    ingress, engine = tmp_path / "serve" / "replica_tandem_ingress_a.log", tmp_path / "worker-1-2.err"
    _append(ingress, '{"message": "POST /v1/completions 200", "request_id": "r1"}\n{"message": "par')
    _append(engine, 'INFO text from Ray\n{"component": "engine-core", "request_id": "cmpl-r1-0"}\n')
    _append(tmp_path / "serve" / "proxy_1.log", "INFO a text line of the proxy\n")
    _append(tmp_path / "raylet.out", '{"json": "but not a file followed"}\n')
    assert follower.poll() == 2
    assert follower.poll() == 0  # printed once
    _append(ingress, 'tial", "request_id": "r2"}\n')
    assert follower.poll() == 1
    assert [line.get("request_id") for line in _lines(out)] == ["r1", "cmpl-r1-0", "r2"]


def test_a_replaced_file_is_read_from_its_start(tmp_path):
    out = io.BytesIO()
    follower = LogFollower(tmp_path, out)
    log = tmp_path / "serve" / "controller_1.log"
    _append(log, '{"n": 1}\n{"n": 2}\n')
    follower.poll()
    os.replace(log, tmp_path / "serve" / "controller_1.log.1")  # rotated: a new file takes the name
    _append(log, '{"n": 3}\n')
    follower.poll()
    assert [line["n"] for line in _lines(out)] == [1, 2, 3]


def test_the_module_runs_as_a_light_process_and_follows(tmp_path):
    follower = subprocess.Popen([sys.executable, "-m", "cluster.shared.log_follow", "--dir", str(tmp_path),
                                 "--interval", "0.05"], stdout=subprocess.PIPE)
    try:
        _append(tmp_path / "serve" / "replica_x.log", '{"request_id": "late"}\n')
        line = follower.stdout.readline()  # blocks until the follower prints it
        assert json.loads(line) == {"request_id": "late"}
    finally:
        follower.terminate()
        follower.wait(timeout=30)
    imported = subprocess.run([sys.executable, "-c", "import sys, cluster.shared.log_follow; "
                                  "print('torch' in sys.modules, 'ray' in sys.modules)"],
                                 capture_output=True, text=True, check=True)
    assert imported.stdout.split() == ["False", "False"]
