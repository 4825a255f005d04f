"""``tandem bench compare``: one workload, several serving systems, ratios in one run.

Two forms (``--form``; ``both`` runs them one after the other):

- ``peers`` (issue 10): Tandem's ``tandem serve CONFIG`` (``make serve``) against vLLM's
  CPU server (``vllm_cpu.sh``, same model, float32), each with and without n-gram
  speculation: four systems, started one at a time.
- ``groups`` (issue 11): one Tandem cluster with a ``native`` and a ``vllm`` replica group
  (the same engine settings); the workload is sent through the ingress and router to each
  group in turn (``X-Tandem-Group``). vLLM must be importable by the serving interpreter
  (``--python``; by default this one, else the vLLM tier's environment).

Each system gets the same requests (``serve_workload``, seeded), the same arrival times and
concurrency cap, and ``num_warmups`` untimed requests first. The load generator and the
metrics are those of ``tandem bench serve``. Ratios are ``A / B`` for each pair (Tandem /
vLLM, native / vllm): below 1 a latency of A is lower, above 1 a throughput of A is higher.
Prints a table per pair and writes everything (per-system summaries and ratios) as JSON.
Numbers measured on a shared machine are noisy; a comparison means one run, same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from cluster.bench.args import positive_int
from cluster.bench.benchmark import Benchmark
from cluster.bench.compare_servers import python_with_vllm, start_or_report, start_tandem, start_vllm_anchor
from cluster.bench.serve import ServeBenchOptions, run_serve_benchmark
from cluster.bench.serve_workload import DATASETS
from cluster.bench.spec_vllm import VLLM_ALL_CORES

NGRAM = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4}
LATENCY_KEYS = [f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "p90", "p99")]
THROUGHPUT_KEYS = ["request_throughput", "output_throughput", "total_token_throughput"]
DEFAULT_ANCHOR = Path(__file__).resolve().parents[3] / "shared" / "anchors" / "vllm_cpu.sh"


def ratios(a: dict, b: dict) -> dict[str, float | None]:
    """``a[key] / b[key]`` for every compared metric (None where either is missing or b is 0)."""
    out = {}
    for key in LATENCY_KEYS + THROUGHPUT_KEYS:
        x, y = a.get(key), b.get(key)
        out[key] = (x / y) if x is not None and y else None
    return out


def _options(args: argparse.Namespace, url: str, headers: tuple = ()) -> ServeBenchOptions:
    return ServeBenchOptions(
        url=url, model=args.served_model_name, dataset=args.dataset, num_prompts=args.num_prompts,
        request_rate=args.request_rate, max_concurrency=args.max_concurrency, seed=args.seed, temperature=0.0,
        ignore_eos=True, random_input_len=args.random_input_len, random_output_len=args.output_len,
        output_len=args.output_len, num_warmups=args.num_warmups, show_progress=not args.disable_tqdm,
        headers=headers,
    )


def _measure(args, server, headers: tuple = ()) -> dict:
    result = asyncio.run(run_serve_benchmark(_options(args, server.url, headers)))
    return result.summary


def _run_peers(args, console) -> dict:
    systems = {}
    for speculation in (True, False):
        tag = "spec" if speculation else "nospec"
        vllm_spec = {**NGRAM, "num_speculative_tokens": args.num_speculative_tokens} if speculation else None
        systems[f"tandem-{tag}"] = _one(console, f"tandem-{tag}", lambda: start_tandem(
            f"tandem-{tag}", args.config, speculation, args.python_native), args)
        systems[f"vllm-{tag}"] = _one(console, f"vllm-{tag}", lambda: start_vllm_anchor(
            f"vllm-{tag}", args.vllm_script, vllm_spec, ["--max-num-seqs", str(args.max_num_seqs)],
            VLLM_ALL_CORES), args)
    pairs = {f"tandem/vllm ({tag})": (f"tandem-{tag}", f"vllm-{tag}") for tag in ("spec", "nospec")}
    return {"systems": systems, "pairs": pairs, "ratios": _pair_ratios(systems, pairs)}


def _run_groups(args, console) -> dict:
    python = args.python_vllm or python_with_vllm()
    if python is None:
        raise ValueError("the groups form needs an interpreter with vLLM: pass --python-vllm, or build the "
                         "vLLM tier's environment (tests/vllm/make_env.sh)")
    groups = [{"name": "native", "device_kind": "cpu", "num_cpus": 1},
              {"name": "vllm", "device_kind": "cpu", "num_cpus": 1, "engine": "vllm"}]
    console.print(f"[bold]starting one Tandem cluster with a native and a vLLM group[/] ({python})")
    server = start_tandem("cluster", args.config, True, python, groups)
    systems = {}
    try:
        for group in ("native", "vllm"):
            console.print(f"[bold]group {group}[/] through the router at {server.url}")
            systems[f"group-{group}"] = _measure(args, server, (("X-Tandem-Group", group),))
    finally:
        server.stop()
    pairs = {"native/vllm (one cluster)": ("group-native", "group-vllm")}
    return {"systems": systems, "pairs": pairs, "ratios": _pair_ratios(systems, pairs), "python": python}


def _one(console, name: str, start, args) -> dict:
    server = start_or_report(console, name, start)
    if isinstance(server, dict):
        return server
    try:
        return _measure(args, server)
    finally:
        server.stop()


def _pair_ratios(systems: dict, pairs: dict) -> dict:
    out = {}
    for label, (a, b) in pairs.items():
        if "error" in systems.get(a, {"error": 1}) or "error" in systems.get(b, {"error": 1}):
            out[label] = None
        else:
            out[label] = ratios(systems[a], systems[b])
    return out


def print_report(console, report: dict) -> None:
    for form in ("peers", "groups"):
        part = report.get(form)
        if not part:
            continue
        for label, (first, second) in part["pairs"].items():
            values = part["ratios"][label]
            table = Table(title=f"{form}: {label}", box=box.SIMPLE_HEAD, show_edge=False,
                          caption="ratio = first / second: below 1 the first has the lower latency; "
                          "above 1 the higher throughput")
            table.add_column("metric")
            for column in (first, second, "ratio"):
                table.add_column(column, justify="right")
            for key in LATENCY_KEYS + THROUGHPUT_KEYS:
                x = part["systems"].get(first, {}).get(key)
                y = part["systems"].get(second, {}).get(key)
                r = None if values is None else values[key]
                table.add_row(key, _fmt(x), _fmt(y), _fmt(r))
            console.print(table)
            for name in (first, second):
                if "error" in part["systems"].get(name, {}):
                    console.print(f"[red]{name}:[/] {part['systems'][name]['error']}")


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def add_compare_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("config", nargs="?", default="configs/local.yaml", help="the Tandem config served (default configs/local.yaml)")
    add("--form", choices=["peers", "groups", "both"], default="both",
        help="peers: tandem serve vs vLLM's server, with and without n-gram; groups: a native and a vLLM group "
             "of one Tandem cluster")
    add("--vllm-script", type=Path, default=DEFAULT_ANCHOR, help="vLLM's CPU anchor script (vllm_cpu.sh)")
    add("--python-native", default=None, help="interpreter for `tandem serve` in the peers form (default: this one)")
    add("--python-vllm", default=None, help="interpreter with Tandem and vLLM for the groups form")
    add("--served-model-name", default="smollm2-135m-instruct", help="the model id both servers answer to")
    add("--num-speculative-tokens", type=positive_int, default=6,
        help="vLLM's k in the peers form (Tandem: its config)")
    add("--max-num-seqs", type=positive_int, default=64, help="vLLM server's --max-num-seqs (peers form)")
    add("--dataset", choices=DATASETS, default="instructions")
    add("--num-prompts", type=positive_int, default=16)
    add("--request-rate", type=float, default=float("inf"))
    add("--max-concurrency", type=positive_int, default=4)
    add("--random-input-len", type=positive_int, default=128)
    add("--output-len", type=positive_int, default=64, help="max_tokens of every request (ignore_eos)")
    add("--num-warmups", type=int, default=2)
    add("--seed", type=int, default=0)
    add("--disable-tqdm", action="store_true")


def measure_compare(args: argparse.Namespace, console: Console) -> dict:
    """Every pair of the chosen form(s), one system at a time; returns the JSON result."""
    args.python_native = args.python_native or sys.executable
    if args.form in ("peers", "both") and not Path(args.vllm_script).is_file():
        raise ValueError(f"the vLLM anchor script {args.vllm_script} does not exist (--vllm-script)")
    report: dict = {"config": str(args.config), "form": args.form, "workload": {
        "dataset": args.dataset, "num_prompts": args.num_prompts, "output_len": args.output_len,
        "max_concurrency": args.max_concurrency, "request_rate": str(args.request_rate), "seed": args.seed,
        "num_warmups": args.num_warmups, "ignore_eos": True, "temperature": 0.0},
        "vllm_placement": "every core for its engine (VLLM_CPU_NUM_OF_RESERVED_CPU=0), as Tandem's"}
    if args.form in ("peers", "both"):
        report["peers"] = _run_peers(args, console)
    if args.form in ("groups", "both"):
        report["groups"] = _run_groups(args, console)
    return report


COMPARE = Benchmark("compare", "one workload against Tandem and vLLM (servers, or the native and vLLM groups of one "
                    "cluster): ratios", add_compare_args, measure_compare, print_report,
                    default_json=Path("bench-compare.json"))
