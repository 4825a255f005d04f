"""Ray clusters a test starts with ``ray start`` beside the session's own (which the process is
connected to): finding and killing exactly their processes (never ``ray stop``, which would
take the session's cluster down too), and keeping ``ray start``'s record of the current
cluster from redirecting later ``ray.init()`` calls."""

from __future__ import annotations

import os
import signal
from pathlib import Path


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
