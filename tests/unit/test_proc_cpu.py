"""Where a served cell's CPU went: every process's threads from /proc, and the client that ran to
completion meanwhile (which the threads' reading misses once it has ended)."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from rich.console import Console

from cluster.bench.proc_cpu import ProcessCpuSampler
from cluster.bench.served_report import print_served_report

BURN = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\n"


def test_a_client_that_ended_in_the_interval_is_counted_beside_the_processes():
    sampler = ProcessCpuSampler()
    sampler.start()
    subprocess.run([sys.executable, "-c", BURN], check=True)
    exec(BURN)  # this process burns as much itself
    cpu = sampler.stop()
    ours = {p["pid"]: p["percent"] for p in cpu["processes"]}
    assert ours.get(os.getpid(), 0) > 0
    assert cpu["ended_children_percent"] > 0
    # 0.3 s of CPU each over an interval of at least 0.6 s: neither can pass one core's 100%
    assert cpu["ended_children_percent"] <= 100


def _cell(throughput: float, cpu: dict) -> dict:
    figures = dict.fromkeys(["request_throughput", "mean_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                             "p99_tpot_ms", "median_itl_ms", "mean_e2el_ms"], 1.0)
    return figures | {"output_throughput": throughput, "cpu": cpu}


def test_the_report_says_where_each_servers_cpu_went():
    def cpu(engine: str, client: float) -> dict:
        return {"seconds": 10.0, "total_percent": 150.0, "cores": 2, "ended_children_percent": client,
                "processes": [{"pid": 1, "command": engine, "percent": 140.0, "threads": []}]}

    report = {"systems": {"tandem": {"random @ 2/s": _cell(160.0, cpu("tandem-engine-core", 31.0))},
                          "vllm-all-cores": {"random @ 2/s": _cell(170.0, cpu("vllm-engine-core", 33.0))}}}
    out = io.StringIO()
    print_served_report(Console(file=out, width=200), report)
    text = out.getvalue()
    assert "tandem: CPU over the cell (150% of 200%, and 31% the client): 140% tandem-engine-core" in text
    assert "vllm-all-cores: CPU over the cell (150% of 200%, and 33% the client): 140% vllm-engine-core" in text
