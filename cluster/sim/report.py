"""What ``tandem sim`` shows: a table per comparison, PNG plots, and the JSON of the run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from rich import box
from rich.console import Console
from rich.table import Table

from cluster.sim.config import SimConfig
from cluster.sim.device_model import StepModel

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2E"))


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def cell_name(summary: dict) -> str:
    return f"{summary['router']} / {summary['controller']}"


def print_report(config: SimConfig, models: dict[str, StepModel], capacity_rps: float, summaries: list[dict]) -> None:
    console = Console(width=None if Console().is_terminal else 200)
    console.print(f"[bold]tandem sim[/bold] {config.name}: {summaries[0]['num_requests']} requests, "
                  f"cluster capacity ~{capacity_rps:.3g} req/s (initial replicas)")
    for group in config.groups:
        model = models[group.name]
        label = "DERIVED from published figures, not measured" if model.derived else "measured"
        console.print(f"  {group.name}: {group.device} x{group.num_replicas if not group.autoscaling else 'auto'}, "
                      f"step times {label} ({model.source}), ${model.price_per_hour:g}/h (assumed list price)")
    table = Table(box=box.SIMPLE_HEAD, show_edge=False)
    table.add_column("router / controller")
    for _, label in LATENCIES:
        table.add_column(f"{label} p50/p90/p99 (ms)", justify="right")
    for column in ("req/s", "out tok/s", "goodput req/s", "$/M out tok"):
        table.add_column(column, justify="right")
    for s in summaries:
        lat = ["/".join(_fmt(s[f"p{p}_{name}_ms"]) for p in (50, 90, 99)) for name, _ in LATENCIES]
        table.add_row(cell_name(s), *lat, _fmt(s["request_throughput"]), _fmt(s["output_throughput"]),
                      _fmt(s["goodput"]), _fmt(s["cost_per_million_output_tokens"]))
    console.print(table)
    shares = Table(box=box.SIMPLE_HEAD, show_edge=False, title="per group: share of requests, mean k, acceptance, most replicas alive at once")
    shares.add_column("router / controller")
    for group in config.groups:
        shares.add_column(group.name, justify="right")
    for s in summaries:
        shares.add_row(cell_name(s), *(f"{g['share_of_requests']:.0%} k={g['mean_k']:.2f} a={g['acceptance']:.2f} "
                                       f"x{g['max_replicas_live']}" for g in s["groups"].values()))
    console.print(shares)
    console.print(f"SLOs for goodput: TTFT <= {config.slo.ttft_s:g} s, TPOT <= {config.slo.tpot_s:g} s")


def write_plots(summaries: list[dict], directory: Path, name: str) -> list[Path]:
    """Latency percentiles per cell (one panel per latency), and throughput/goodput/cost."""
    # here, not at the top: pyplot would add ~0.4 s to every tandem command, for the plots only
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    labels = [cell_name(s) for s in summaries]
    x = np.arange(len(labels))
    fig, axes = plt.subplots(1, 3, figsize=(5 * 3, 4.5))
    for ax, (key, title) in zip(axes, LATENCIES):
        for j, p in enumerate((50, 90, 99)):
            values = [s[f"p{p}_{key}_ms"] or 0.0 for s in summaries]
            ax.bar(x + (j - 1) * 0.27, values, 0.27, label=f"p{p}")
        ax.set_title(f"{title} (ms)")
        ax.set_xticks(x, labels, rotation=45, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    latency_path = directory / f"{name}-latency.png"
    fig.savefig(latency_path, dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (key, title) in zip(axes, (("output_throughput", "output tokens/s"), ("goodput", "goodput (req/s)"),
                                       ("cost_per_million_output_tokens", "$ per million output tokens (assumed)"))):
        ax.bar(x, [s[key] or 0.0 for s in summaries])
        ax.set_title(title)
        ax.set_xticks(x, labels, rotation=45, ha="right", fontsize=8)
    fig.tight_layout()
    throughput_path = directory / f"{name}-throughput.png"
    fig.savefig(throughput_path, dpi=110)
    plt.close(fig)
    return [latency_path, throughput_path]


def write_json(path: Path, config: SimConfig, models: dict[str, StepModel], capacity_rps: float,
               summaries: list[dict], comparison: dict | None = None) -> None:
    data = {
        "config": config.model_dump(),
        "capacity_rps": capacity_rps,
        "step_models": {name: {"source": m.source, "derived": m.derived, "target_coef": m.latency.target_coef,
                               "draft_coef": m.latency.draft_coef, "acceptance": list(m.acceptance),
                               "kv_capacity_tokens": m.kv_capacity_tokens,
                               "price_per_hour_assumed": m.price_per_hour} for name, m in models.items()},
        "cells": summaries,
    }
    if comparison is not None:
        data["validation"] = comparison
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
