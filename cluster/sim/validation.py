"""Simulated against measured: the latency percentiles of a ``tandem bench router`` JSON.

``tandem bench router --json`` holds one run per router policy (``runs[policy].summary``,
the metrics of ``tandem bench serve``); ``tandem sim`` of the same cluster gives one
summary per (router, controller) cell. For each router present in both, every
percentile is compared as error = simulated / measured - 1 (so -0.2 means the
simulation predicted 20% less than was measured).
"""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

METRICS = [(f"p{p}_{name}_ms", f"{label} p{p} (ms)") for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"),
                                                                          ("e2el", "E2E")) for p in (50, 90, 99)]
METRICS += [("request_throughput", "requests/s"), ("output_throughput", "output tok/s")]


def compare(measured: dict, summaries: list[dict]) -> dict[str, list[dict]]:
    """Per router: rows of {metric, label, measured, simulated, error}."""
    runs = measured.get("runs", {})
    result: dict[str, list[dict]] = {}
    for summary in summaries:
        router = summary["router"]
        if router not in runs or router in result:
            continue
        real = runs[router]["summary"]
        rows = []
        for key, label in METRICS:
            m, s = real.get(key), summary.get(key)
            error = s / m - 1 if m and s is not None else None
            rows.append({"metric": key, "label": label, "measured": m, "simulated": s, "error": error})
        result[router] = rows
    if not result:
        raise ValueError(f"the measured JSON has no run of the simulated routers ({', '.join(runs) or 'none'})")
    return result


def print_comparison(comparison: dict[str, list[dict]]) -> None:
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, title="simulated vs measured (error = sim / measured - 1)")
    table.add_column("metric")
    for router in comparison:
        for column in ("measured", "simulated", "error"):
            table.add_column(f"{router} {column}", justify="right")
    for i, (_, label) in enumerate(METRICS):
        cells = []
        for rows in comparison.values():
            row = rows[i]
            cells += [_fmt(row["measured"]), _fmt(row["simulated"]),
                      "-" if row["error"] is None else f"{row['error']:+.0%}"]
        table.add_row(label, *cells)
    Console(width=None if Console().is_terminal else 160).print(table)


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
