"""``tandem bench router``: Tandem's router against power-of-two choices, same load.

For each policy in turn the application is deployed on local Ray with ``serve.router`` set
to it, the same seeded workload is replayed, the ingress's routing decisions are read from
``/debug/router``, and the application is torn down. ``pow2`` is what Ray Serve's default
router does across replicas (two random ones, the less loaded wins). The table reports
latency percentiles per policy and the ratio tandem / pow2; the JSON holds both runs in full.

Workloads: ``random`` (independent prompts at ``--request-rate``, through
:func:`run_serve_benchmark`) and ``agentic`` (the agentic set's conversations replayed turn
after turn, ``--concurrent-conversations`` at a time or arriving at ``--conversation-rate``,
:mod:`cluster.bench.conversation_replay`), whose table has first and later turns apart: a
later turn's history sits in the prefix cache of the replica that served the turn before.

The cluster: a config whose groups have two or more replicas in all is used as it is (two
vLLM replicas, say). A single group of one replica is split into ``fast`` and ``slow``, the
same engine with every step of the slow group stretched by ``--slow-factor``
(``step_time_scale``) to emulate a slower kind of device (one torch thread per engine so the
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
from cluster.bench.conversation_replay import replay_conversations, summarize_turns
from cluster.bench.serve import ServeBenchOptions, run_serve_benchmark
from cluster.bench.serve_metrics import percentile_key
from cluster.bench.serve_workload import BenchRequest
from cluster.bench.workloads.agentic_prompts import agentic_prompt_texts, load_conversations
from cluster.config import TandemConfig, config_from_dict, group_engine_config, load_config
from cluster.metrics.exposition import sample_total
from cluster.models.loader import load_tokenizer, resolve_model

POLICIES = ("tandem", "pow2")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_cluster_config(config: TandemConfig, policy: str, slow_factor: float, port: int) -> TandemConfig:
    """``config`` with ``serve.router = policy`` on ``port``; a single group of one replica becomes fast + slow."""
    data = config.model_dump()
    serve = data["serve"]
    serve.update(router=policy, port=port, host="127.0.0.1", api_key=None, api_key_env=None)
    groups = serve["groups"]
    if len(groups) == 1 and groups[0]["num_replicas"] == 1 and not groups[0]["autoscaling"]:
        base = groups[0]
        base.update(num_replicas=1, autoscaling=None, num_cpus=0.5)
        serve["groups"] = [{**base, "name": "fast", "step_time_scale": 1.0},
                           {**base, "name": "slow", "step_time_scale": slow_factor}]
        data["device"]["num_threads"] = 1
    return config_from_dict(data, f"bench router ({policy})")


def _get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


def _get_json(url: str) -> dict:
    return json.loads(_get_text(url))


def prefix_cache_counters(exposition: str) -> dict | None:
    """Prompt tokens looked up in the replicas' prefix caches and found there, summed over the
    replicas (vLLM's ``vllm:prefix_cache_queries`` / ``hits`` counters on the ingress's
    ``/metrics``), with their ratio; None where the engines publish no such counters."""
    totals = {what: sample_total(exposition, f"vllm:prefix_cache_{what}_total") or 0.0 for what in ("queries", "hits")}
    if not totals["queries"]:
        return None
    return {**totals, "hit_rate": totals["hits"] / totals["queries"]}


@dataclasses.dataclass(frozen=True)
class Conversations:
    """The ``agentic`` workload: each conversation's turns, in order, and how to play them."""

    turns: list[list[BenchRequest]]
    concurrency: int
    rate: float | None  # conversations arriving per second (open loop); None: ``concurrency`` at a time
    think_s: float
    warmups: list[BenchRequest]
    seed: int = 0  # of the arrivals


def agentic_conversations(config: TandemConfig, args: argparse.Namespace) -> Conversations:
    """The agentic set's first ``--conversations`` conversations, every turn rendered with the
    served model's tokenizer; the first turns of the next ``--num-warmups`` ones warm up."""
    convs = load_conversations()
    if not 1 <= args.conversations <= len(convs) - args.num_warmups:
        raise ValueError(f"--conversations must be 1..{len(convs) - args.num_warmups} "
                         f"(the set has {len(convs)}, {args.num_warmups} of them warm up)")
    model = group_engine_config(config, config.serve.groups[0].name).model
    tokenizer = load_tokenizer(resolve_model(model.model, model.cache_dir))

    def turns(conv) -> list[BenchRequest]:
        return [BenchRequest(text, args.output_len, len(tokenizer.encode(text, add_special_tokens=False)))
                for text in agentic_prompt_texts(tokenizer, [conv])]

    measured = [turns(conv) for conv in convs[:args.conversations]]
    warmups = [turns(conv)[0] for conv in convs[args.conversations:args.conversations + args.num_warmups]]
    return Conversations(measured, args.concurrent_conversations, args.conversation_rate, args.think_time, warmups,
                         args.seed)


def _play(url: str, workload: ServeBenchOptions | Conversations) -> dict:
    if isinstance(workload, Conversations):
        replay = asyncio.run(replay_conversations(url, workload.turns, workload.concurrency,
                                                  conversation_rate=workload.rate, seed=workload.seed,
                                                  think_s=workload.think_s, warmups=workload.warmups))
        summaries = summarize_turns(replay)
        return {"summary": summaries["all"], "turns": summaries,
                "requests": [{"conversation": t.conversation, "turn": t.turn, **t.record.to_json()}
                             for t in replay.turns]}
    result = asyncio.run(run_serve_benchmark(dataclasses.replace(workload, url=url)))
    return {"summary": result.summary, "requests": [r.to_json() for r in result.records]}


def run_policy(config: TandemConfig, workload: ServeBenchOptions | Conversations) -> dict:
    """Deploy ``config``, replay the workload, return the summaries and the routing decisions."""
    # here, not at the top: the tandem command builds its parser from this module and must not load Ray
    from ray import serve

    from deployments.local import start_local

    url = start_local(config, app_name=f"bench-router-{config.serve.router}", blocking=False)
    try:
        played = _play(url, workload)
        router = _get_json(f"{url}/debug/router")
        cache = prefix_cache_counters(_get_text(f"{url}/metrics"))
    finally:
        serve.shutdown()
    return {"policy": config.serve.router, **played, "router": router, **({"prefix_cache": cache} if cache else {})}


def _ratio(a, b):
    return None if a is None or not b else a / b


def _row(runs: dict[str, dict], key: str, label: str, part: str | None = None) -> tuple[str, str, list]:
    values = [(runs[policy]["turns"][part] if part else runs[policy]["summary"]).get(key) for policy in POLICIES]
    return (f"{part}.{key}" if part else key, label, [*values, _ratio(values[0], values[1])])


def report_rows(runs: dict[str, dict]) -> list[tuple[str, str, list]]:
    """(metric key, label, values per policy + tandem/pow2 ratio) for the table; a conversation
    run has its TTFT of first and of later turns first."""
    rows = []
    turns = runs[POLICIES[0]].get("turns", {})
    for part, name in (("first_turns", "first turns"), ("later_turns", "later turns")):
        if part in turns:
            for p in ("median", "mean", percentile_key(99)):
                rows.append(_row(runs, f"{p}_ttft_ms", f"TTFT {name} {p} (ms)", part))
    for name, label in (("ttft", "TTFT"), ("e2el", "E2E latency"), ("tpot", "TPOT")):
        for p in ("median", percentile_key(99)):
            rows.append(_row(runs, f"{p}_{name}_ms", f"{label} {p} (ms)"))
    for key, label in (("request_throughput", "requests/s"), ("output_throughput", "output tok/s")):
        rows.append(_row(runs, key, label))
    return rows


def traffic_share(router_snapshot: dict) -> dict[str, float]:
    decisions = router_snapshot.get("decisions", {})
    total = sum(decisions.values())
    return {group: count / total for group, count in decisions.items()} if total else {}


def measure_router(args: argparse.Namespace, console: Console) -> dict:
    """The same workload through each routing policy on its own local cluster; returns the JSON result."""
    import ray  # here, not at the top: the tandem command imports this module and must not load Ray

    base = load_config(args.config)
    if args.workload == "agentic":
        workload = agentic_conversations(base, args)
    else:
        workload = ServeBenchOptions(
            dataset="random", num_prompts=args.num_prompts, request_rate=args.request_rate,
            burstiness=args.burstiness, seed=args.seed, random_input_len=args.input_len,
            random_output_len=args.output_len, ignore_eos=True, num_warmups=args.num_warmups,
            show_progress=not args.disable_tqdm,
        )
    runs: dict[str, dict] = {}
    try:
        for policy in POLICIES:
            config = bench_cluster_config(base, policy, args.slow_factor, _free_port())
            runs[policy] = run_policy(config, workload)
    finally:
        if ray.is_initialized():
            ray.shutdown()
    for policy in POLICIES:
        runs[policy]["share"] = traffic_share(runs[policy]["router"])
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if not callable(v)}
    groups = [{**g.model_dump(), "backend": group_engine_config(config, g.name).engine.backend}
              for g in config.serve.groups]
    return {"config": settings, "groups": groups,
            "ratios": {key: values[-1] for key, _, values in report_rows(runs)}, "runs": runs}


def print_router(console: Console, result: dict) -> None:
    settings, runs = result["config"], result["runs"]
    groups = ", ".join(f"{g['name']} ({g.get('num_replicas', 1)} x {g.get('backend', 'native')}, "
                       f"step x{g['step_time_scale']:g})" for g in result["groups"])
    if settings.get("workload") == "agentic":
        rate = settings.get("conversation_rate")
        start = (f"arriving at {rate:g}/s" if rate is not None
                 else f"{settings['concurrent_conversations']} at a time")
        workload = (f"{settings['conversations']} agentic conversations, {start}, each turn after the last "
                    f"answer (think time {settings['think_time']:g} s)")
    else:
        workload = (f"{settings['num_prompts']} requests at {settings['request_rate']:g}/s "
                    f"(burstiness {settings['burstiness']:g}), {settings['input_len']} prompt words")
    console.print(f"[bold]router benchmark[/bold]: {groups}; {workload}, {settings['output_len']} output tokens")
    table = Table(box=box.SIMPLE_HEAD, show_edge=False)
    for column in ("metric", *POLICIES, "tandem / pow2"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for _, label, values in report_rows(runs):
        table.add_row(label, *("-" if v is None else f"{v:.3g}" if abs(v) < 10 else f"{v:.0f}" for v in values))
    for group in runs[POLICIES[0]]["share"]:
        table.add_row(f"share to {group}", *(f"{runs[p]['share'].get(group, 0):.0%}" for p in POLICIES), "")
    if all("prefix_cache" in runs[p] for p in POLICIES):
        table.add_row("prefix cache hits / queried tokens",
                      *(f"{runs[p]['prefix_cache']['hit_rate']:.0%}" for p in POLICIES), "")
    choices = {p: runs[p].get("router", {}).get("replica_choices") for p in POLICIES}
    if choices[POLICIES[0]]:
        table.add_row("in-group choices: ranked / fell back",
                      *(f"{c.get('ranked', 0)} / {c.get('fallback', 0)}" if c else "-" for c in choices.values()), "")
        table.add_row("  a prefix cached / the deepest first",
                      *(f"{c.get('prefix_found', 0)} / {c.get('deepest_prefix_first', 0)}" if c else "-"
                        for c in choices.values()), "")
    table.add_row("failed requests", *(str(runs[p]["summary"]["failed"]) for p in POLICIES), "")
    console.print(table)


def add_router_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("config", nargs="?", default="configs/local.yaml", help="YAML settings (default configs/local.yaml)")
    add("--slow-factor", type=float, default=3.0, help="step-time stretch of the slow group (single-group configs)")
    add("--workload", choices=["random", "agentic"], default="random",
        help="random: independent prompts at --request-rate; agentic: the agentic set's multi-turn conversations")
    add("--conversations", type=int, default=12, help="agentic: conversations played")
    add("--concurrent-conversations", type=int, default=4, help="agentic: conversations at a time")
    add("--conversation-rate", type=float, default=None,
        help="agentic: conversations arriving per second (Poisson, --seed) instead of a fixed number at a time")
    add("--think-time", type=float, default=0.0, help="agentic: seconds between an answer and the next turn")
    add("--num-prompts", type=int, default=120)
    add("--request-rate", type=float, default=2.0, help="requests/s, the same for both policies")
    add("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    add("--input-len", type=int, default=64, help="prompt words (~tokens)")
    add("--output-len", type=int, default=64, help="output tokens (ignore_eos)")
    add("--num-warmups", type=int, default=4,
        help="untimed requests first, one at a time (agentic: first turns of conversations not measured)")
    add("--seed", type=int, default=0)
    add("--disable-tqdm", action="store_true")


ROUTER = Benchmark("router", "Tandem's router vs power-of-two choices, same cluster and workload",
                   add_router_args, measure_router, print_router, default_json=Path("bench-router.json"))
