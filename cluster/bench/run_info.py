"""How and where a benchmark result was made, stamped into every ``tandem bench`` JSON as ``run``.

A figure means little without the command that made it, the tree it ran from and the
machine it ran on: these machines change CPU kind (AVX2, AVX-512, AVX-512 with AMX) and
core count between runs, and load from other work shows in the load averages.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path

from cluster.shared.cpu_info import cpu_kind, cpu_model

_REPO = Path(__file__).resolve().parents[2]


def start_run_info(benchmark: str, argv: list[str] | None = None) -> dict:
    """The stamp's first half, taken before measuring; ``argv`` is the command (default: this process's)."""
    return {"benchmark": benchmark, "argv": argv or sys.argv,
            "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "code": code_version(), "machine": machine(), "load_average_start": list(os.getloadavg())}


def finish_run_info(started: dict, wall_s: float) -> dict:
    """The whole stamp: ``started`` with the wall time, the load at the end and torch's threads."""
    torch = sys.modules.get("torch")  # read, never imported here: HTTP benchmarks do not load torch
    return started | {"wall_s": wall_s, "load_average_end": list(os.getloadavg()),
                      "torch_threads": torch.get_num_threads() if torch is not None else None}


def machine() -> dict:
    return {"cpu": cpu_model(), "cpu_kind": cpu_kind(),
            "cores_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "cpu_count": os.cpu_count(), "python": platform.python_version()}


def code_version() -> dict:
    """The package version and, when run from a git checkout, its commit and whether it had edits."""
    try:
        version = importlib.metadata.version("tandem-serve")
    except importlib.metadata.PackageNotFoundError:
        version = None
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"version": version, "commit": commit, "uncommitted_changes": bool(status) if commit else None}


def _git(*args: str) -> str | None:
    if not (_REPO / ".git").exists():
        return None
    try:
        done = subprocess.run(["git", "-C", str(_REPO), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None

