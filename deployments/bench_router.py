"""``tandem bench router``: Tandem's router against power-of-two choices, same load.

A two-group cluster on local Ray: ``fast`` and ``slow``, the same engine with every step
of the slow group stretched by ``--slow-factor`` (``step_time_scale``) to emulate a
slower kind of device. For each policy in turn the application is deployed with
``serve.router`` set to it, the same seeded workload is replayed through
:func:`run_serve_benchmark`, the ingress's routing decisions are read from
``/debug/router``, and the application is torn down. ``pow2`` is what Ray Serve's
default router does across replicas (two random ones, the less loaded wins), applied
over the replicas of both groups. The table reports latency percentiles per policy
and the ratio tandem / pow2; the JSON holds both runs in full.

A config with two or more ``serve.groups`` is used as it is; one with a single group
is split into the fast/slow pair (one replica each, one torch thread per engine so the
two replicas do not fight over the cores).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import socket
import urllib.request
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from cluster.bench.benchmark import Benchmark
from cluster.bench.serve import ServeBenchOptions, run_serve_benchmark
from cluster.bench.serve_metrics import percentile_key
from cluster.config import TandemConfig, config_from_dict, load_config

POLICIES = ("tandem", "pow2")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_cluster_config(config: TandemConfig, policy: str, slow_factor: float, port: int) -> TandemConfig:
    """``config`` with ``serve.router = policy`` on ``port``; a single group becomes fast + slow."""
    data = config.model_dump()
    serve = data["serve"]
    serve.update(router=policy, port=port, host="127.0.0.1", api_key=None, api_key_env=None)
    if len(serve["groups"]) == 1:
        base = serve["groups"][0]
        base.update(num_replicas=1, autoscaling=None, num_cpus=0.5)
        serve["groups"] = [{**base, "name": "fast", "step_time_scale": 1.0},
                           {**base, "name": "slow", "step_time_scale": slow_factor}]
        data["device"]["num_threads"] = 1
    return config_from_dict(data, f"bench router ({policy})")


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def run_policy(config: TandemConfig, options: ServeBenchOptions) -> dict:
    """Deploy ``config``, replay the workload, return the summary and the routing decisions."""
    # here, not at the top: the tandem command builds its parser from this module and must not load Ray
    from ray import serve

    from deployments.local import start_local

    url = start_local(config, app_name=f"bench-router-{config.serve.router}", blocking=False)
    try:
        result = asyncio.run(run_serve_benchmark(dataclasses.replace(options, url=url)))
        router = _get_json(f"{url}/debug/router")
    finally:
        serve.shutdown()
    return {"policy": config.serve.router, "summary": result.summary, "router": router,
            "requests": [r.to_json() for r in result.records]}


def _ratio(a, b):
    return None if a is None or not b else a / b


def report_rows(runs: dict[str, dict]) -> list[tuple[str, str, list]]:
    """(metric key, label, values per policy + tandem/pow2 ratio) for the table."""
    rows = []
    for name, label in (("ttft", "TTFT"), ("e2el", "E2E latency"), ("tpot", "TPOT")):
        for p in ("median", percentile_key(99)):
            key = f"{p}_{name}_ms"
            values = [runs[policy]["summary"].get(key) for policy in POLICIES]
            rows.append((key, f"{label} {p} (ms)", [*values, _ratio(values[0], values[1])]))
    for key, label in (("request_throughput", "requests/s"), ("output_throughput", "output tok/s")):
        values = [runs[policy]["summary"][key] for policy in POLICIES]
        rows.append((key, label, [*values, _ratio(values[0], values[1])]))
    return rows


def traffic_share(router_snapshot: dict) -> dict[str, float]:
    decisions = router_snapshot.get("decisions", {})
    total = sum(decisions.values())
    return {group: count / total for group, count in decisions.items()} if total else {}


def measure_router(args: argparse.Namespace, console: Console) -> dict:
    """The same workload through each routing policy on its own local cluster; returns the JSON result."""
    import ray  # here, not at the top: the tandem command imports this module and must not load Ray

    base = load_config(args.config)
    options = ServeBenchOptions(
        dataset="random", num_prompts=args.num_prompts, request_rate=args.request_rate,
        burstiness=args.burstiness, seed=args.seed, random_input_len=args.input_len,
        random_output_len=args.output_len, ignore_eos=True, num_warmups=args.num_warmups,
        show_progress=not args.disable_tqdm,
    )
    runs: dict[str, dict] = {}
    try:
        for policy in POLICIES:
            config = bench_cluster_config(base, policy, args.slow_factor, _free_port())
            runs[policy] = run_policy(config, options)
    finally:
        if ray.is_initialized():
            ray.shutdown()
    for policy in POLICIES:
        runs[policy]["share"] = traffic_share(runs[policy]["router"])
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if not callable(v)}
    return {"config": settings, "groups": [g.model_dump() for g in config.serve.groups],
            "ratios": {key: values[-1] for key, _, values in report_rows(runs)}, "runs": runs}


def print_router(console: Console, result: dict) -> None:
    settings, runs = result["config"], result["runs"]
    groups = ", ".join(f"{g['name']} (step x{g['step_time_scale']:g})" for g in result["groups"])
    console.print(f"[bold]router benchmark[/bold]: {groups}; {settings['num_prompts']} requests at "
                  f"{settings['request_rate']:g}/s (burstiness {settings['burstiness']:g}), "
                  f"{settings['input_len']} prompt words, {settings['output_len']} output tokens")
    table = Table(box=box.SIMPLE_HEAD, show_edge=False)
    for column in ("metric", *POLICIES, "tandem / pow2"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for _, label, values in report_rows(runs):
        table.add_row(label, *("-" if v is None else f"{v:.3g}" if abs(v) < 10 else f"{v:.0f}" for v in values))
    for group in runs[POLICIES[0]]["share"]:
        table.add_row(f"share to {group}", *(f"{runs[p]['share'].get(group, 0):.0%}" for p in POLICIES), "")
    table.add_row("failed requests", *(str(runs[p]["summary"]["failed"]) for p in POLICIES), "")
    console.print(table)


def add_router_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("config", nargs="?", default="configs/local.yaml", help="YAML settings (default configs/local.yaml)")
    add("--slow-factor", type=float, default=3.0, help="step-time stretch of the slow group (single-group configs)")
    add("--num-prompts", type=int, default=120)
    add("--request-rate", type=float, default=2.0, help="requests/s, the same for both policies")
    add("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    add("--input-len", type=int, default=64, help="prompt words (~tokens)")
    add("--output-len", type=int, default=64, help="output tokens (ignore_eos)")
    add("--num-warmups", type=int, default=4, help="untimed requests first, one at a time")
    add("--seed", type=int, default=0)
    add("--disable-tqdm", action="store_true")


ROUTER = Benchmark("router", "Tandem's router vs power-of-two choices on a fast+slow cluster",
                   add_router_args, measure_router, print_router, default_json=Path("bench-router.json"))
