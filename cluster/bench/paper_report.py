"""The rich tables of ``tandem bench paper``, printed from its JSON."""

from __future__ import annotations

from pathlib import Path

from rich import box
from rich.table import Table


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def print_tables(console, result: dict) -> None:
    if result["settings"].get("proportions"):
        _print_pair(console, result)
    _print_sweep(console, result)
    _print_traffic(console, result)
    _print_goals(console, result)


def _print_pair(console, result: dict) -> None:
    """The pair's shapes and its measured pass times (the profile's grid): how its proportions came out."""
    pair, profile = result["settings"]["proportions"], result["profile"]
    for role in ("target", "draft"):
        shape = pair[role]
        console.print(f"{pair['name']} {role}: {shape['family']}, layers {shape['num_layers']}, hidden "
                      f"{shape['hidden_size']}, intermediate {shape['intermediate_size']}, {shape['num_heads']} heads "
                      f"({shape['num_kv_heads']} KV), vocabulary {shape['vocab_size']}, {pair['dtype']}")
    target = {(b, n): s for b, n, s in profile["target_grid"]}
    draft = dict(profile["draft_grid"])
    widths = sorted({n for _, n in target})
    table = Table(title=f"Pass times, ms, of the {pair['name']} pair (the profile's grid)", box=box.SIMPLE_HEAD,
                  show_edge=False,
                  caption="target: one pass over that many tokens per request; x: against 1 token; draft: one "
                          "pass of one token per request, and its share of the target's 1-token pass")
    table.add_column("batch", justify="right")
    for n in widths:
        table.add_column(f"target {n} tok", justify="right")
    table.add_column("draft", justify="right")
    for b in sorted({b for b, _ in target}):
        one = target.get((b, 1))
        cells = [_fmt(1e3 * target[b, n], ".2f") + ("" if one is None or n == 1 else f" ({target[b, n] / one:.2f}x)")
                 if (b, n) in target else "-" for n in widths]
        share = "" if one is None or b not in draft else f" ({draft[b] / one:.0%})"
        table.add_row(str(b), *cells, _fmt(None if b not in draft else 1e3 * draft[b], ".2f") + share)
    console.print(table)


def _print_sweep(console, result: dict) -> None:
    settings, sweep, profile = result["settings"], result["tpot_vs_k"], result["profile"]
    model = f"{settings['proportions']['name']} pair" if settings.get("proportions") else Path(settings["model"]).name
    cells = {(c["batch_size"], c["k"]): c for c in sweep["cells"]}
    best = {p["batch_size"]: p["best_k"] for p in sweep["per_batch"]}
    table = Table(
        title=f"TPOT ms vs k, measured / predicted, {model} {settings['dtype']} {settings['method']}, "
              f"{settings['output_len']} tokens per request, batch submitted at once, "
              f"{settings['prompts']} prompts{_synthetic(settings)}",
        caption=f"predicted: the latency model fitted by run_profile (fit error {profile['fit_error']:.1%}) with the "
                f"acceptance the controllers start from, measured on the {profile['acceptance_prompts']} prompts ("
                + ", ".join(f"{a:.2f}" for a in profile["acceptance"]) + "); bold: best measured k",
        box=box.SIMPLE_HEAD, show_edge=False,
    )
    table.add_column("batch", justify="right")
    for k in settings["ks"]:
        table.add_column(f"k={k}", justify="right")
    for b in settings["batch_sizes"]:
        row = []
        for k in settings["ks"]:
            c = cells[(b, k)]
            text = f"{_fmt(c['tpot_ms'], '.1f')} / {c['predicted_tpot_ms']:.1f}"
            row.append(f"[bold]{text}[/]" if k == best[b] else text)
        table.add_row(str(b), *row)
    console.print(table)

    table = Table(
        title=f"Best k per batch size: measured vs the latency model{_synthetic(result['settings'])}",
        caption="model k: argmin of the predicted TPOT (profile acceptance); regret: measured TPOT at model k over "
                "the best; model k (acc.): argmin with each cell's own measured acceptance; table k: the "
                "profile's table (read from its measured grid; regret - where the sweep did not run that k); "
                "|err|: mean |predicted / measured - 1| over k; step |err| fit / grid: the same for the time of a "
                "step of the whole batch decoding, as the fitted line and the measured grid (what the table and "
                "adaptive read) predict it at the coverage drafted; accept: accepted / drafted at the largest k\n"
                f"best k non-increasing as the batch grows: {'yes' if sweep['best_k_non_increasing'] else 'no'}; "
                f"falls from the smallest to the largest batch: {'yes' if sweep['best_k_falls'] else 'no'}; "
                f"mean |err| {_fmt(sweep['mean_abs_prediction_error'], '.1%')} (profile acceptance), "
                f"{_fmt(sweep['mean_abs_prediction_error_measured_acceptance'], '.1%')} (measured acceptance); "
                f"step |err| {_fmt(sweep.get('mean_abs_step_error_fit'), '.1%')} (fit), "
                f"{_fmt(sweep.get('mean_abs_step_error_grid'), '.1%')} (grid)",
        box=box.SIMPLE_HEAD, show_edge=False,
    )
    for header in ("batch", "best k", "TPOT ms", "k=0 ms", "speedup", "model k", "regret", "model k (acc.)",
                   "table k", "regret", "|err|", "step |err| fit / grid", "accept"):
        table.add_column(header, justify="right")
    for p in sweep["per_batch"]:
        table.add_row(str(p["batch_size"]), str(p["best_k"]), _fmt(p["best_tpot_ms"], ".1f"),
                      _fmt(p["k0_tpot_ms"], ".1f"), _fmt(p["speedup_vs_k0"], ".2f"), str(p["model_k"]),
                      _pct(p["model_k_regret"]), _fmt(p["model_k_measured_acceptance"], "d"),
                      _fmt(p.get("table_k"), "d"), _pct(p.get("table_k_regret")),
                      _fmt(p["mean_abs_prediction_error"], ".1%"),
                      " / ".join(_fmt(p.get(f"mean_abs_step_error_{m}"), ".1%") for m in ("fit", "grid")),
                      _fmt(p["acceptance_rate_at_top_k"], ".0%"))
    console.print(table)


def _print_traffic(console, result: dict) -> None:
    settings, capacity = result["settings"], result["capacity"]
    cap = (f"capacity {capacity['requests_per_s']:.2f} req/s measured (batch {capacity['batch_size']}, "
           f"k={capacity['k']})" if capacity["source"] == "measured" else "rates given by --rates")
    table = Table(
        title=f"Open-loop Poisson traffic, {settings['requests']} requests per run, {settings['output_len']} tokens "
              f"each, same arrival trace for every policy{_synthetic(settings)}",
        caption=f"{cap}; each policy's median of {settings.get('repeats', 1)} runs (each run: its mean TPOT, in "
                "order); vs best: mean TPOT over the best fixed k's (- is faster); latency and TTFT from the "
                "scheduled arrival; batch and k: means over steps",
        box=box.SIMPLE_HEAD, show_edge=False,
    )
    for header in ("workload", "policy", "TPOT ms", "vs best", "each run", "latency s", "TTFT s", "tok/s", "batch",
                   "k", "accept"):
        table.add_column(header, justify="left" if header in ("workload", "policy") else "right")
    for i, w in enumerate(result["traffic"]["workloads"]):
        if i:
            table.add_section()
        rates = " -> ".join(f"{p['rate']:.2f}" for p in w["phases"]) + " req/s"
        for j, r in enumerate(w["runs"]):
            policy = r["policy"]
            if policy == w["best_fixed"]["policy"]:
                policy = f"[bold]{policy}[/] (best fixed)"
            table.add_row(w["name"] if j == 0 else (rates if j == 1 else ""), policy, f"{r['mean_tpot_ms']:.1f}",
                          _pct(r["gap_vs_best_fixed"]), " ".join(f"{t:.1f}" for t in r.get("repeat_mean_tpot_ms", [])),
                          f"{r['mean_latency_s']:.2f}", f"{r['mean_ttft_s']:.2f}",
                          f"{r['throughput_tok_s']:.1f}", f"{r['mean_batch_size']:.1f}", f"{r['mean_k']:.2f}",
                          _fmt(r["acceptance_rate"], ".0%"))
    console.print(table)


def _print_goals(console, result: dict) -> None:
    table = Table(title=f"Goals (gap: policy TPOT / best fixed k TPOT - 1){_synthetic(result['settings'])}",
                  box=box.SIMPLE_HEAD, show_edge=False,
                  caption="per-phase k: the best fixed k of each phase picked in hindsight from the fixed-k runs, "
                          "the most any controller could gain over the best single k here (noise flatters it); "
                          "run to run: how far repeated runs of one fixed k fall apart (median over the fixed k's "
                          "of slowest / fastest - 1), the noise a gap must clear")
    for header in ("goal", "workload", "adaptive", "table", "per-phase k", "run to run", "met"):
        table.add_column(header, justify="left" if header in ("goal", "workload") else "right")
    for g in result["goals"]:
        table.add_row(g["goal"], g["workload"], _pct(g["adaptive_gap"]), _pct(g["table_gap"]),
                      _pct(g.get("phase_oracle_gap")), _pct(g.get("run_to_run")),
                      ("yes" if g["met"] else "no") + ", within noise" if g.get("within_noise")
                      else "[green]yes[/]" if g["met"] else "[red]no[/]")
    console.print(table)
    share = [r["prefill_step_share"] for w in result["traffic"]["workloads"] for r in w["runs"]
             if r.get("prefill_step_share") is not None]
    if share:
        console.print(f"share of step time in steps carrying a prompt's prefill: {min(share):.0%}-{max(share):.0%} "
                      "over the runs kept (the speculation length hardly changes those steps)")
    console.print(f"wall time {result['wall_s'] / 60:.1f} min; load average at start "
                  + ", ".join(f"{x:.2f}" for x in result["machine"]["load_average_1_5_15m"]))


def _synthetic(settings: dict) -> str:
    """The title's mark of a run whose drafts were accepted as drawn (``--synthetic-acceptance``)."""
    label = settings.get("synthetic_acceptance")
    return f", {label} (drawn, not verified)" if label else ""

