"""The PNG figures of ``tandem bench paper`` (matplotlib, Agg backend), drawn from its JSON."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    # here, not at the top: pyplot would add ~0.4 s to every tandem command, for the plots only
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _integer_ticks():
    # here, not at the top: matplotlib would add ~0.06 s to every tandem command, for the plots only
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


def write_plots(result: dict, folder: Path) -> list[Path]:
    """Draw every figure into ``folder`` (created if missing); returns the files written."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = [_tpot_vs_k(result, folder / "tpot_vs_k.png")]
    if result["traffic"]["workloads"]:
        paths.append(_traffic_bars(result, folder / "traffic_tpot.png"))
    phased = [w for w in result["traffic"]["workloads"] if w["kind"] == "phased"]
    if phased:
        paths.append(_k_over_time(phased[0], folder / "phased_k_over_time.png"))
    return paths


def _tpot_vs_k(result: dict, path: Path) -> Path:
    plt = _pyplot()
    cells = result["tpot_vs_k"]["cells"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, b in enumerate(result["settings"]["batch_sizes"]):
        row = sorted((c for c in cells if c["batch_size"] == b), key=lambda c: c["k"])
        ks = [c["k"] for c in row]
        color = f"C{i}"
        ax.plot(ks, [c["tpot_ms"] for c in row], "o-", color=color, label=f"batch {b}")
        ax.plot(ks, [c["predicted_tpot_ms"] for c in row], "--", color=color, alpha=0.8)
    ax.xaxis.set_major_locator(_integer_ticks())
    ax.set_xlabel("speculation length k")
    ax.set_ylabel("TPOT (ms per output token)")
    ax.set_title("TPOT vs k: measured (solid), latency model (dashed)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _traffic_bars(result: dict, path: Path) -> Path:
    plt = _pyplot()
    workloads = result["traffic"]["workloads"]
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 4), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        runs = w["runs"]
        names = [r["policy"] for r in runs]
        colors = ["C2" if n == "adaptive" else "C1" if n == "table" else
                  "C0" if n == w["best_fixed"]["policy"] else "0.7" for n in names]
        ax.bar(names, [r["mean_tpot_ms"] for r in runs], color=colors)
        ax.axhline(w["best_fixed"]["mean_tpot_ms"], color="C0", linestyle=":", linewidth=1)
        rates = "/".join(f"{p['rate']:.2f}" for p in w["phases"])
        ax.set_title(f"{w['kind']}, {rates} req/s", fontsize=9)
        ax.set_ylabel("mean TPOT (ms)")
        ax.tick_params(axis="x", labelrotation=60, labelsize=8)
    fig.suptitle("Mean TPOT per policy (blue: best fixed k, orange: table, green: adaptive)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _k_over_time(workload: dict, path: Path) -> Path:
    plt = _pyplot()
    runs = {r["policy"]: r for r in workload["runs"]}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    for name, color in (("adaptive", "C2"), ("table", "C1")):
        steps = runs.get(name, {}).get("steps", [])
        if not steps:
            continue
        t = [s["t_s"] for s in steps]
        top.step(t, [s["num_running"] for s in steps], where="post", color=color, label=name, linewidth=1)
        bottom.step(t, [s["k"] for s in steps], where="post", color=color, label=name, linewidth=1)
    # Phase boundaries: the first arrival of each phase after the first.
    arrivals, seen = workload["arrival_s"], 0
    for phase in workload["phases"][:-1]:
        seen += phase["num_requests"]
        for ax in (top, bottom):
            ax.axvline(arrivals[seen], color="0.5", linestyle=":", linewidth=1)
    top.yaxis.set_major_locator(_integer_ticks())
    bottom.yaxis.set_major_locator(_integer_ticks())
    top.set_ylabel("batch size")
    bottom.set_ylabel("k chosen")
    bottom.set_xlabel("seconds since the run started")
    top.set_title("Phased traffic (low, high, low): batch size and k over time")
    top.legend(fontsize=8)
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
