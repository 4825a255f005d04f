"""Ray clusters a test starts with ``ray start`` beside the session's own (which the process is
connected to): finding and killing exactly their processes (never ``ray stop``, which would
take the session's cluster down too), and keeping ``ray start``'s record of the current
cluster from redirecting later ``ray.init()`` calls. ``ray_cluster`` is such a cluster on
loopback (4 CPUs), driven by Ray's own command-line tools (``run_tool``)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

BIN = Path(sys.executable).parent


def cluster_pids(gcs_port: int, marker: str = "") -> list[int]:
    """Processes of the cluster whose GCS listens on ``gcs_port`` (with ``marker`` in their command line)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if (f":{gcs_port}" in args or f"--gcs_server_port={gcs_port}" in args) and marker in args:
            pids.append(int(entry.name))
    return pids


def with_descendants(pids: list[int]) -> list[int]:
    """``pids`` and every process below them (a raylet's workers, a replica's engine core)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def command_line(pid: int) -> str:
    """What /proc shows (a Ray worker's title, e.g. ``ray::ServeReplica:tandem:replica-fast``)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# `ray start --head` records its address here, and a later `ray.init()` on this machine (the
# other serve tests' local clusters) would try to join that cluster: put back what was there.
CURRENT_CLUSTER = Path("/tmp/ray/ray_current_cluster")


def restore(saved: bytes | None) -> None:
    if saved is None:
        CURRENT_CLUSTER.unlink(missing_ok=True)
    else:
        CURRENT_CLUSTER.write_bytes(saved)


def run_tool(*args: str, env: dict, timeout: float = 180) -> str:
    """A tool of this environment's (``ray``, ``serve``, ``python``) run to success; its stdout."""
    done = subprocess.run([str(BIN / args[0]), *args[1:]], capture_output=True, text=True, env=env, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(args)}: {done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture()
def ray_cluster():
    """The environment (``RAY_DASHBOARD_ADDRESS``) of a Ray cluster of the test's own."""
    from tests.serve.conftest import free_port

    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's socket paths must stay under 108 bytes
    gcs, dashboard = free_port(), free_port()
    env = {**os.environ, "RAY_DASHBOARD_ADDRESS": f"http://127.0.0.1:{dashboard}", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    saved = CURRENT_CLUSTER.read_bytes() if CURRENT_CLUSTER.exists() else None
    try:
        run_tool("ray", "start", "--head", f"--port={gcs}", "--node-ip-address=127.0.0.1", "--num-cpus=4",
                 "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
                 f"--temp-dir={temp}", "--disable-usage-stats", env=env)
        restore(saved)
        yield env
    finally:
        kill(with_descendants(cluster_pids(gcs)))  # this cluster's processes only, not the session's
        restore(saved)
        shutil.rmtree(temp, ignore_errors=True)


def wait_app_running(env: dict, app: str = "tandem", timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while True:
        status = yaml.safe_load(run_tool("serve", "status", env=env)) or {}
        state = (status.get("applications") or {}).get(app, {})
        if state.get("status") == "RUNNING":
            return
        assert time.time() < deadline, f"never RUNNING: {status}"
        time.sleep(2)
