"""vLLM's CPU server as the peer of ``tandem bench spec``.

For each ``k`` of ``--vllm-ks`` the ``vllm_cpu.sh`` anchor starts ``vllm serve`` on a
free local port (``k = 0``: no ``--speculative-config``; otherwise n-gram prompt lookup
with n from 1 to 4, as Tandem's default), prefix caching off, the same dtype. Each batch
size then gets an untimed warm-up and one timed run: the same prompt token ids as Tandem,
streamed from ``/v1/completions`` by ``batch size`` client threads (closed loop), greedy,
``ignore_eos``. TTFT and TPOT come from the stream's chunk arrival times, token counts
from the final usage chunk, acceptance from the deltas of vLLM's ``/metrics`` counters.
This measures vLLM *through its HTTP server* (HTTP and detokenization included) while
Tandem runs offline in-process. The stdlib ``urllib`` is the client: no extra dependency.

Any failure (no anchor script, setup or start-up error, a broken stream) is recorded and
reported; it never loses Tandem's results.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from cluster.bench.spec_cells import WARMUP_LEN, RequestTiming, SpecCell, SpecCounts, make_cell

SERVED_NAME = "smollm2-135m-instruct"  # the anchor's --served-model-name
START_TIMEOUT_S = 1800  # a first start may install vLLM (a few minutes) before serving
# vLLM's CPU build reserves a core for its front end unless told not to: with this, its engine gets
# every core, as Tandem's does (its better setting for serving on a 2-core machine, measured).
VLLM_ALL_CORES = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
REQUEST_TIMEOUT_S = 900
NGRAM_MIN, NGRAM_MAX = 1, 4
MODE = ("vLLM's OpenAI server over HTTP (streaming /v1/completions, concurrency = batch size): "
        "includes HTTP and detokenization; Tandem is measured offline in-process")
_METRIC = re.compile(r'^(vllm:spec_decode_num_(?:drafts|draft_tokens|accepted_tokens|accepted_tokens_per_pos)_total)'
                     r'(\{[^}]*\})?\s+(\S+)$')


@dataclass
class VllmResult:
    enabled: bool
    cells: list[SpecCell] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    version: str | None = None
    script: str | None = None

    def to_json(self) -> dict:
        status = "off" if not self.enabled else ("failed" if not self.cells else
                                                 "partial" if self.errors else "ok")
        return {"enabled": self.enabled, "status": status, "errors": self.errors, "version": self.version,
                "script": self.script, "mode": MODE, "speculative_config": {
                    "method": "ngram", "prompt_lookup_min": NGRAM_MIN, "prompt_lookup_max": NGRAM_MAX}}


def free_port() -> int:
    """A port the OS just handed out on 127.0.0.1 (free now; vLLM binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure_vllm(args, prompt_ids: list[list[int]], console, progress, task) -> VllmResult:
    result = VllmResult(enabled=True, script=str(args.vllm_script))
    if not os.access(args.vllm_script, os.X_OK):
        result.errors.append(f"the vLLM anchor script {args.vllm_script} is missing or not executable "
                             "(--vllm-script)")
        progress.advance(task, len(args.vllm_ks) * len(args.batch_sizes))
        return result
    started_once = False
    for i, k in enumerate(args.vllm_ks):
        num_cells = len(result.cells)
        try:
            progress.update(task, description=f"starting vLLM, k={k} (the first start may install it)")
            started_once |= _measure_server(args, k, prompt_ids, result, progress, task)
        except Exception as err:  # the peer must never cost Tandem's results
            result.errors.append(f"k={k}: {type(err).__name__}: {err}")
            console.print(f"[bold red]vLLM k={k} failed:[/] {type(err).__name__}: {err}")
            progress.advance(task, len(args.batch_sizes) - (len(result.cells) - num_cells))
            if isinstance(err, _StartError) and not started_once:
                skipped = args.vllm_ks[i + 1:]
                if skipped:
                    result.errors.append(f"vLLM never started; k={skipped} not tried")
                    progress.advance(task, len(skipped) * len(args.batch_sizes))
                break
    return result


class _StartError(RuntimeError):
    """The server did not come up (setup, model conversion or start-up failed)."""


def _measure_server(args, k: int, prompt_ids, result: VllmResult, progress, task) -> bool:
    """Start the server for ``k``, measure every batch size, stop it; True once it started."""
    port = free_port()
    cmd = [str(args.vllm_script), "serve", str(port), "--dtype", args.dtype, "--no-enable-prefix-caching",
           "--max-num-seqs", str(max(args.batch_sizes))]
    if k > 0:
        cmd += ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": k,
                                                    "prompt_lookup_max": NGRAM_MAX,
                                                    "prompt_lookup_min": NGRAM_MIN})]
    try:
        started = subprocess.run(cmd, capture_output=True, text=True, timeout=START_TIMEOUT_S,
                                 env={**os.environ, **VLLM_ALL_CORES})
    except subprocess.TimeoutExpired:
        _stop_servers_on(args.vllm_script, port)
        raise _StartError(f"vllm_cpu.sh serve did not return within {START_TIMEOUT_S} s") from None
    lines = started.stdout.strip().splitlines()
    if started.returncode != 0 or not lines or not lines[-1].isdigit():
        _stop_servers_on(args.vllm_script, port)  # the script leaves a server that never answered running
        tail = "\n".join((started.stderr or started.stdout).strip().splitlines()[-15:])
        raise _StartError(f"vllm_cpu.sh serve exited with {started.returncode}:\n{tail}")
    pid = int(lines[-1])
    base = f"http://127.0.0.1:{port}"
    try:
        result.version = result.version or _get_json(f"{base}/version").get("version")
        for batch_size in args.batch_sizes:
            progress.update(task, description=f"vLLM batch {batch_size}, k={k}")
            _run_clients(base, prompt_ids[:batch_size], min(WARMUP_LEN, args.output_len), batch_size)
            before = _scrape_counts(base)
            timings, seconds = _run_clients(base, prompt_ids, args.output_len, batch_size)
            counts = _scrape_counts(base).minus(before)  # all 0 at k = 0: vLLM exports no counters then
            result.cells.append(make_cell("vllm", "ngram", batch_size, k, args.output_len, timings, seconds,
                                          counts))
            progress.advance(task)
    finally:
        _stop(args.vllm_script, pid)
    return True


def _stop(script, pid: int) -> None:
    subprocess.run([str(script), "stop", str(pid)], capture_output=True, timeout=60)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the next cell must not share the cores with this server
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)


def _stop_servers_on(script, port: int) -> None:
    """Stop the server this run started on ``port`` if the script gave up on it without its pid."""
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "vllm.entrypoints.openai.api_server" in argv and "--port" in argv \
                and argv[argv.index("--port") + 1:][:1] == [str(port)]:
            _stop(script, int(entry))


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def _scrape_counts(base: str) -> SpecCounts:
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as resp:
        return parse_spec_counts(resp.read().decode())


def parse_spec_counts(text: str) -> SpecCounts:
    """vLLM's speculative counters in Prometheus text, summed over label sets (0 when absent)."""
    totals = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        match = _METRIC.match(line)
        if not match:
            continue
        name, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
        kind = name[len("vllm:spec_decode_num_"):-len("_total")]
        if kind == "accepted_tokens_per_pos":
            pos = re.search(r'position="(\d+)"', labels)
            if pos:
                per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0.0) + value
        else:
            totals[kind] += value
    positions = tuple(int(per_pos.get(j, 0)) for j in range(max(per_pos) + 1)) if per_pos else ()
    return SpecCounts(int(totals["drafts"]), int(totals["draft_tokens"]), int(totals["accepted_tokens"]), positions)


def _run_clients(base: str, prompt_ids, output_len: int, concurrency: int) -> tuple[list[RequestTiming], float]:
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        timings = list(pool.map(lambda ids: _stream_one(base, ids, output_len), prompt_ids))
    return timings, time.perf_counter() - start


def _stream_one(base: str, prompt_ids: list[int], output_len: int) -> RequestTiming:
    body = {"model": SERVED_NAME, "prompt": prompt_ids, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    sent = time.perf_counter()
    first = last = None
    num_tokens = None
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("choices"):
                last = time.perf_counter()
                first = first or last
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
    if first is None or num_tokens is None:
        raise RuntimeError("vLLM's stream ended without tokens or without a usage chunk")
    return RequestTiming(first - sent, last - first, num_tokens)
