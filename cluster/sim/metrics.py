"""The summary of one simulated run, under the definitions of ``tandem bench serve``.

Per request: TTFT = first token - arrival; E2E = finish - arrival; TPOT = (E2E - TTFT) /
(output tokens - 1) for outputs longer than one token. Over the run, ``duration`` is
first arrival to last finish: request and output-token throughput are per second of
it, goodput counts the requests meeting both SLOs (TTFT and TPOT; no TPOT counts as
0, as vLLM does). Percentiles are numpy's linear interpolation, in milliseconds.

Cost: every replica is paid from the moment it is created (starting included) until it
stops or the run ends, at its group's price per hour (an *assumed* list price); the
cost per million output tokens is that sum over the output tokens.
"""

from __future__ import annotations

import numpy as np

from cluster.bench.serve_metrics import peak_overlap
from cluster.sim.config import SloConfig
from cluster.sim.engine import SimResult

PERCENTILES = (50, 90, 99)


def latency_stats(name: str, seconds: np.ndarray) -> dict[str, float | None]:
    values = seconds[~np.isnan(seconds)] * 1000.0
    stats: dict[str, float | None] = {f"mean_{name}_ms": float(values.mean()) if len(values) else None}
    for p in PERCENTILES:
        stats[f"p{p}_{name}_ms"] = float(np.percentile(values, p)) if len(values) else None
    return stats


def summarize(result: SimResult, slo: SloConfig) -> dict:
    table = result.requests
    finished = ~np.isnan(table.finish_s)
    ttft = table.first_token_s - table.arrival_s
    e2e = table.finish_s - table.arrival_s
    out = table.output_len.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(out > 1, (e2e - ttft) / (out - 1), np.nan)
    duration = float(np.nanmax(table.finish_s) - table.arrival_s.min()) if finished.any() else 0.0
    output_tokens = int(table.output_len[finished].sum())
    prompt_tokens = int(table.prompt_len[finished].sum())
    good = finished & (ttft <= slo.ttft_s) & (np.nan_to_num(tpot, nan=0.0) <= slo.tpot_s)
    summary: dict = {
        "router": result.router, "controller": result.controller,
        "num_requests": len(table), "completed": int(finished.sum()),
        "duration_s": duration,
        "request_throughput": finished.sum() / duration if duration else 0.0,
        "output_throughput": output_tokens / duration if duration else 0.0,
        "total_token_throughput": (output_tokens + prompt_tokens) / duration if duration else 0.0,
        "goodput": good.sum() / duration if duration else 0.0,
        "goodput_fraction": float(good.sum() / len(table)) if len(table) else 0.0,
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("e2el", e2e)):
        summary.update(latency_stats(name, values))
    dollars, groups = 0.0, {}
    for group in result.groups:
        replica_seconds = sum(life.stopped_s - life.created_s for life in group.lives)
        cost = replica_seconds / 3600.0 * group.model.price_per_hour
        dollars += cost
        indices = [replica_index(life.replica.replica_id) for life in group.lives]
        routed = int(np.isin(table.replica, indices).sum())
        steps = np.sum([life.replica.k_steps for life in group.lives], axis=0)
        drafted = sum(life.replica.num_drafted for life in group.lives)
        accepted = sum(life.replica.num_accepted for life in group.lives)
        groups[group.config.name] = {
            "device": group.config.device, "step_times": group.model.source,
            "replicas_created": len(group.lives),
            "max_replicas_live": max_live(group),
            "replica_hours": replica_seconds / 3600.0, "dollars": cost,
            "price_per_hour_assumed": group.model.price_per_hour,
            "share_of_requests": routed / len(table) if len(table) else 0.0,
            "mean_k": float(np.dot(steps, np.arange(len(steps))) / steps.sum()) if steps.sum() else 0.0,
            "acceptance": accepted / drafted if drafted else 0.0,
            "preemptions": sum(life.replica.num_preemptions for life in group.lives),
            "busy_fraction": (sum(life.replica.busy_seconds for life in group.lives) / replica_seconds
                              if replica_seconds else 0.0),
        }
    summary["dollars"] = dollars
    summary["cost_per_million_output_tokens"] = dollars / output_tokens * 1e6 if output_tokens else None
    summary["groups"] = groups
    summary["router_fallbacks"] = result.router_fallbacks
    summary["wall_seconds"] = result.wall_seconds
    summary["num_events"] = result.num_events
    return summary


def replica_index(replica_id: str) -> int:
    """The global replica index in ``<group>-<index>``."""
    return int(replica_id.rsplit("-", 1)[1])


def max_live(group) -> int:
    """The most replicas of ``group`` alive (created, not stopped) at once."""
    return peak_overlap([(life.created_s, life.stopped_s) for life in group.lives])
