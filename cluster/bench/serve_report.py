"""The table and the PNG figures of ``tandem bench serve``, drawn from its JSON dict.

Figures (matplotlib, Agg backend): ``latency_cdf.png``, the empirical CDFs of TTFT and
TPOT over the successful requests; ``throughput.png``, output tokens/s and completed
requests/s in time bins over the run. A chunk's tokens are taken as the request's
output tokens spread evenly over its content chunks (a chunk carries no token count).
"""

from __future__ import annotations

from pathlib import Path

from rich import box
from rich.table import Table

from cluster.bench.serve_metrics import percentile_key

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency"))


def _fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def print_summary(console, result: dict) -> None:
    """Print the run's overview and a latency table (milliseconds)."""
    s, config = result["summary"], result["config"]
    pieces = [f"{p['rate']:g}/s for {p['duration_s']:g} s" for p in config["phases"]]
    traffic = "phases " + ", ".join(pieces) if pieces else f"rate {config['request_rate']}/s"
    console.print(f"[bold]serving benchmark[/bold]: {result['model']} via {config['endpoint']}, "
                  f"dataset {config['dataset']}, {traffic}, burstiness {config['burstiness']:g}, "
                  f"max concurrency {config['max_concurrency'] or 'none'}")
    overview = Table(box=box.SIMPLE_HEAD, show_edge=False)
    overview.add_column("metric")
    overview.add_column("value", justify="right")
    rows = [
        ("successful requests", str(s["completed"])),
        ("failed requests", str(s["failed"])),
        ("benchmark duration (s)", _fmt(s["duration_s"])),
        ("total input tokens", str(s["total_input_tokens"])),
        ("total output tokens", str(s["total_output_tokens"])),
        ("request throughput (req/s)", _fmt(s["request_throughput"])),
        ("request goodput (req/s)", _fmt(s["request_goodput"])),
        ("output token throughput (tok/s)", _fmt(s["output_throughput"])),
        ("total token throughput (tok/s)", _fmt(s["total_token_throughput"])),
        ("max concurrent requests", str(s["max_concurrent_requests"])),
    ]
    for row in rows:
        overview.add_row(*row)
    console.print(overview)

    keys = ["mean", "median", "std", *(percentile_key(p) for p in s["percentiles"])]
    latency = Table(title="latency (ms)", box=box.SIMPLE_HEAD, show_edge=False,
                    caption="TPOT per token excluding the first; ITL between content chunks")
    latency.add_column("metric")
    for key in keys:
        latency.add_column(key, justify="right")
    for name, label in LATENCIES:
        latency.add_row(label, *(_fmt(s[f"{key}_{name}_ms"]) for key in keys))
    console.print(latency)
    errors = sorted({r["error"] for r in result["requests"] if not r["success"]})
    for error in errors[:3]:
        console.print(f"[red]failed:[/red] {error}")


def _pyplot():
    # here, not at the top: pyplot would add ~0.4 s to every tandem command, for the plots only
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(result: dict, folder: Path) -> list[Path]:
    """Draw both figures into ``folder`` (created if missing); returns the files written."""
    folder.mkdir(parents=True, exist_ok=True)
    return [_latency_cdf(result, folder / "latency_cdf.png"), _throughput(result, folder / "throughput.png")]


def _latency_cdf(result: dict, path: Path) -> Path:
    plt = _pyplot()
    ok = [r for r in result["requests"] if r["success"]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "ttft_s", "TTFT"), (axes[1], "tpot_s", "TPOT")):
        values = sorted(r[key] * 1e3 for r in ok if r[key] is not None)
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post")
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{result['model']}: latency CDFs over {len(ok)} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _throughput(result: dict, path: Path) -> Path:
    plt = _pyplot()
    duration = result["summary"]["duration_s"]
    bin_s = 1.0 if duration >= 30 else max(duration / 30, 1e-3)
    num_bins = int(duration / bin_s) + 1
    tokens, done = [0.0] * num_bins, [0] * num_bins
    for r in result["requests"]:
        if not r["success"]:
            continue
        per_chunk = r["output_tokens"] / len(r["chunk_times_s"])
        for t in r["chunk_times_s"]:
            tokens[min(num_bins - 1, int((r["start_s"] + t) / bin_s))] += per_chunk
        done[min(num_bins - 1, int((r["start_s"] + r["e2e_s"]) / bin_s))] += 1
    times = [i * bin_s for i in range(num_bins)]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.step(times, [t / bin_s for t in tokens], where="post", color="C0", label="output tok/s")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens/s", color="C0")
    ax.grid(alpha=0.3)
    twin = ax.twinx()
    twin.step(times, [d / bin_s for d in done], where="post", color="C1", label="completed req/s")
    twin.set_ylabel("completed requests/s", color="C1")
    ax.set_title(f"{result['model']}: throughput over time ({bin_s:.3g} s bins)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
