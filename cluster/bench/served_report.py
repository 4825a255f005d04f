"""The tables of ``tandem bench served``: per cell, Tandem beside each peer (both vLLM placements and the
better of them; llama.cpp's server) in each round, with ``--rounds``, and the median of the rounds'
ratios), the served / offline ratio, and where Tandem's CPU time went. A peer's runs are the systems
whose names start with its prefix (``vllm``, ``llamacpp``)."""

from __future__ import annotations

import statistics

from rich import box
from rich.table import Table

# vLLM client result keys: (label, higher is better)
FIGURES = {
    "output_throughput": ("output tok/s", True),
    "request_throughput": ("requests/s", True),
    "mean_ttft_ms": ("TTFT mean (ms)", False),
    "p99_ttft_ms": ("TTFT p99 (ms)", False),
    "median_tpot_ms": ("TPOT median (ms)", False),
    "p99_tpot_ms": ("TPOT p99 (ms)", False),
    "median_itl_ms": ("ITL median (ms)", False),
    "mean_e2el_ms": ("E2E mean (ms)", False),
}
GOAL_FIGURES = ("output_throughput", "mean_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")


PEERS = ("vllm", "llamacpp")
# per-cell counters read from the servers' /metrics: (key, label, scale)
COUNTER_ROWS = (("acceptance_rate", "drafts accepted (%)", 100),
                ("mean_acceptance_length", "tokens a drafting step", 1), ("num_preemptions", "preemptions", 1))


def best_vllm(systems: dict, cell: str, names: list[str] | None = None, peer: str = "vllm") -> str | None:
    """The run of ``peer`` (of ``names``, default every one) with the higher output throughput in ``cell``."""
    candidates = [(systems[name][cell]["output_throughput"], name) for name in (names or systems)
                  if name.startswith(peer) and isinstance(systems[name].get(cell), dict)
                  and systems[name][cell].get("output_throughput")]
    return max(candidates)[1] if candidates else None


def server_rounds(systems: dict, peer: str = "vllm") -> list[tuple[str, list[str]]]:
    """Each round's Tandem run and the peer's runs beside it: ``tandem`` with every ``vllm-*`` (one
    round), or ``tandem #r`` with ``vllm-* #r`` (``--rounds``)."""
    if "tandem" in systems:
        return [("tandem", [n for n in systems if n.startswith(peer) and "#" not in n])]
    rounds = sorted(int(n.split("#")[1]) for n in systems if n.startswith("tandem #"))
    paired = [(f"tandem #{r}", [n for n in systems if n.startswith(peer) and n.endswith(f" #{r}")]) for r in rounds]
    return [pair for pair in paired if pair[1]]  # a speculation A/B's rounds have no peer beside them


def server_ratios(systems: dict, peer: str = "vllm") -> dict[str, dict[str, dict]]:
    """Per cell and goal figure: Tandem / the round's better run of ``peer`` in each round, their
    median, and whether Tandem is ahead by that median."""
    out: dict[str, dict[str, dict]] = {}
    for index, (tandem, vllm_names) in enumerate(server_rounds(systems, peer)):
        for cell, figures in systems[tandem].items():
            best = best_vllm(systems, cell, vllm_names, peer) if isinstance(figures, dict) else None
            for key, judged in (verdicts(figures, systems[best][cell]) if best else {}).items():
                entry = out.setdefault(cell, {}).setdefault(key, {"rounds": []})
                entry["rounds"] += [None] * (index - len(entry["rounds"])) + [judged["ratio"]]
    for cell in out.values():
        for key, entry in cell.items():
            taken = [r for r in entry["rounds"] if r is not None]
            entry["median"] = statistics.median(taken)
            entry["ahead"] = entry["median"] > 1 if FIGURES[key][1] else entry["median"] < 1
    return out


def verdicts(tandem: dict, vllm: dict) -> dict[str, dict]:
    """Per goal figure: the ratio tandem / vllm and whether Tandem is ahead."""
    out = {}
    for key in GOAL_FIGURES:
        a, b = tandem.get(key), vllm.get(key)
        if a is None or not b:
            continue
        higher = FIGURES[key][1]
        out[key] = {"ratio": a / b, "ahead": a > b if higher else a < b}
    return out


def speculation_gains(systems: dict, base: str = "tandem") -> dict[str, dict[str, float]]:
    """With ``--speculation-ab``: per cell and figure, how many times better the speculating runs
    named ``base`` (CONFIG's, or an alternative's ``tandem:<stem>``) are than none (each side the
    mean over its rounds; > 1: speculation better). With one round the runs are named ``base`` and
    ``tandem-no-spec``, with more ``base #1``, ..."""
    gains: dict[str, dict[str, float]] = {}
    on = [figs for name, figs in systems.items() if name == base or name.startswith(f"{base} #")]
    off = [figs for name, figs in systems.items() if name == "tandem-no-spec" or name.startswith("tandem-no-spec #")]
    if not on or not off:
        return gains
    for cell in on[0]:
        for key, (_, higher_better) in FIGURES.items():
            a = [f[cell][key] for f in on if isinstance(f.get(cell), dict) and f[cell].get(key)]
            b = [f[cell][key] for f in off if isinstance(f.get(cell), dict) and f[cell].get(key)]
            if a and b:
                mean_a, mean_b = sum(a) / len(a), sum(b) / len(b)
                gains.setdefault(cell, {})[key] = mean_a / mean_b if higher_better else mean_b / mean_a
    return gains


def print_speculation_ab(console, report: dict) -> None:
    """Each cell's figures per Tandem run (speculation as configured, each alternative config, and
    none, in turn) and each speculating config's gain over none."""
    systems = report["systems"]
    names = [n for n in systems if n.startswith("tandem")]
    bases = ["tandem", *report.get("settings", {}).get("speculation_alternatives", {})]
    gains = {base: speculation_gains(systems, base) for base in bases}
    for cell in gains["tandem"]:
        table = Table(title=f"{cell}: speculation against none (vLLM's client)", box=box.SIMPLE_HEAD,
                      show_edge=False, caption="gain: how many times better with speculation (means over rounds)")
        table.add_column("figure")
        for name in names:
            table.add_column(name, justify="right")
        for base in bases:
            table.add_column("gain" if len(bases) == 1 else f"gain {base}", justify="right")
        for key, (label, _) in FIGURES.items():
            table.add_row(label, *[_fmt(systems[n].get(cell, {}).get(key)) for n in names],
                          *[_fmt(gains[base].get(cell, {}).get(key)) for base in bases])
        for key, label, scale in COUNTER_ROWS:  # read from each server's /metrics over the cell
            values = [systems[n].get(cell, {}).get(key) for n in names]
            if any(v is not None for v in values):
                table.add_row(label, *[_fmt(None if v is None else v * scale) for v in values], *[""] * len(bases))
        console.print(table)


def print_served_report(console, report: dict) -> None:
    systems = report["systems"]
    if any(name.startswith("tandem-no-spec") for name in systems):
        print_speculation_ab(console, report)
    settings = report.get("settings", {})
    if "vllm" in settings:
        console.print(f"what each got: tandem: {settings['tandem']}; vLLM: dtype {settings['vllm']['dtype']}, "
                      f"--max-num-seqs {settings['vllm']['max_num_seqs']}, placements "
                      f"{', '.join(settings['vllm']['placements'])}; client: {settings['client']}")
    if settings.get("llamacpp"):
        console.print(f"llama.cpp: {settings['llamacpp']}")
    served = [peer for peer in PEERS if any(names for _, names in server_rounds(systems, peer))]
    for peer in served or PEERS[:1]:  # no peer served: Tandem's figures alone, once
        _print_peer(console, report, peer)


def _print_peer(console, report: dict, peer: str) -> None:
    systems = report["systems"]
    rounds = server_rounds(systems, peer)
    if not rounds:
        return
    ratios = server_ratios(systems, peer)
    several = len(rounds) > 1
    for cell in systems[rounds[0][0]]:
        failed = [(t, systems[t][cell]) for t, _ in rounds
                  if not isinstance(systems[t].get(cell), dict) or "error" in systems[t][cell]]
        for tandem, figures in failed:
            console.print(f"[red]{tandem} {cell}:[/] {figures.get('error') if isinstance(figures, dict) else figures}")
        if len(failed) == len(rounds):
            continue
        bests = [best_vllm(systems, cell, names, peer) for _, names in rounds]
        caption = (f"better {peer} run per round: " + ", ".join(str(b) for b in bests)
                   + "; ratio = tandem / that one" + ("; judged by the median ratio over rounds" if several else ""))
        table = Table(title=f"{cell}: tandem and {peer} (vLLM's client)", box=box.SIMPLE_HEAD, show_edge=False,
                      caption=caption)
        table.add_column("figure")
        names = [name for tandem, vllm_names in rounds for name in (tandem, *vllm_names)]
        for name in names:
            table.add_column(name, justify="right")
        ratio_names = [f"ratio #{i + 1}" for i in range(len(rounds))] if several else ["ratio"]
        for label in ratio_names + (["median"] if several else []):
            table.add_column(label, justify="right")
        table.add_column("tandem", justify="left")
        for key, (label, _) in FIGURES.items():
            row = [label] + [_fmt(systems.get(n, {}).get(cell, {}).get(key)) for n in names]
            for (tandem, _), best in zip(rounds, bests):
                a, b = systems[tandem].get(cell, {}).get(key), best and systems[best][cell].get(key)
                row.append(_fmt(a / b if a is not None and b else None, 2))
            judged = ratios.get(cell, {}).get(key)
            if several:
                row.append(_fmt(judged["median"] if judged else None, 2))
            row.append("" if judged is None else ("ahead" if judged["ahead"] else "behind"))
            table.add_row(*row)
        offline = report.get("offline", {}).get(cell)
        for key, label, unit in (("output_throughput", "served / offline engine", "tok/s"),
                                 ("mean_ttft_ms", "TTFT served / offline", "ms"),
                                 ("median_tpot_ms", "TPOT served / offline", "ms")):
            served = [systems[t][cell][key] for t, _ in rounds
                      if isinstance(systems[t].get(cell), dict) and systems[t][cell].get(key)]
            if offline and offline.get(key) and served:
                table.add_row(label, f"{statistics.median(served) / offline[key]:.2f}",
                              *[""] * (len(names) - 1 + len(ratio_names) + several),
                              f"offline {offline[key]:.1f} {unit}")
        console.print(table)
        for name in names:
            _print_cpu(console, name, systems.get(name, {}).get(cell, {}))


def _print_cpu(console, name: str, figures: dict) -> None:
    cpu = figures.get("cpu")
    if cpu:
        parts = [f"{p['percent']:.0f}% {p['command'][:40]}" for p in cpu["processes"][:6]]
        client = cpu.get("ended_children_percent")
        console.print(f"  {name}: CPU over the cell ({cpu['total_percent']:.0f}% of {cpu['cores'] * 100}%"
                      + ("" if client is None else f", and {client:.0f}% the client") + "): " + "; ".join(parts))
    if figures.get("num_preemptions") is not None:
        console.print(f"  {name}: {figures['num_preemptions']:.0f} preemptions over the cell")
    if figures.get("acceptance_rate") is not None:
        console.print(f"  {name}: drafts accepted {100 * figures['acceptance_rate']:.0f}%, "
                      f"{figures['mean_acceptance_length']:.2f} tokens a drafting step")
    timeline = figures.get("engine_timeline")
    if timeline and timeline.get("num_steps"):
        console.print(f"  engine core over the cell ({timeline['num_steps']} steps): busy "
                      f"{100 * timeline['busy_fraction']:.0f}%, batch {timeline['mean_batch_size']:.1f}, "
                      f"{timeline['mean_tokens_per_step']:.1f} tokens/step, step {timeline['mean_step_ms']:.1f} ms "
                      f"(forward+sampling {timeline['mean_forward_and_sampling_ms']:.1f}, python around it "
                      f"{timeline['mean_python_around_forward_ms']:.2f}, hand-off {timeline['mean_handoff_ms']:.2f})")
        if timeline.get("prefill_step_fraction") is not None:
            console.print(f"    {100 * timeline['prefill_step_fraction']:.0f}% of steps carried a prompt's chunk "
                          f"({_fmt(timeline['mean_prefill_step_ms'])} ms, "
                          f"{_fmt(timeline['mean_prefill_tokens_per_prefill_step'])} prompt tokens), decode-only "
                          f"steps {_fmt(timeline['mean_decode_step_ms'])} ms at batch "
                          f"{_fmt(timeline['mean_decode_batch_size'])}; "
                          f"{100 * timeline['drafting_step_fraction']:.0f}% of steps verified drafts")


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
