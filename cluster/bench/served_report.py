"""The tables of ``tandem bench served``: per cell, Tandem beside both vLLM placements and the
better of them, the served / offline ratio, and where Tandem's CPU time went."""

from __future__ import annotations

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


def best_vllm(systems: dict, cell: str) -> str | None:
    """The vLLM placement with the higher output throughput in ``cell``."""
    candidates = [(s[cell]["output_throughput"], name) for name, s in systems.items()
                  if name.startswith("vllm") and isinstance(s.get(cell), dict) and s[cell].get("output_throughput")]
    return max(candidates)[1] if candidates else None


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
        console.print(table)


def print_served_report(console, report: dict) -> None:
    systems = report["systems"]
    if any(name.startswith("tandem-no-spec") for name in systems):
        print_speculation_ab(console, report)
    tandem = systems.get("tandem", {})
    settings = report.get("settings", {})
    if "vllm" in settings:
        console.print(f"what each got: tandem: {settings['tandem']}; vLLM: dtype {settings['vllm']['dtype']}, "
                      f"--max-num-seqs {settings['vllm']['max_num_seqs']}, placements "
                      f"{', '.join(settings['vllm']['placements'])}; client: {settings['client']}")
    for cell, figures in tandem.items():
        if not isinstance(figures, dict) or "error" in figures:
            console.print(f"[red]tandem {cell}:[/] {figures.get('error') if isinstance(figures, dict) else figures}")
            continue
        best = best_vllm(systems, cell)
        table = Table(title=f"{cell} (vLLM's client)", box=box.SIMPLE_HEAD, show_edge=False,
                      caption=f"better vLLM placement here: {best}; ratio = tandem / that one")
        table.add_column("figure")
        names = ["tandem"] + [n for n in systems if n.startswith("vllm")]
        for name in names:
            table.add_column(name, justify="right")
        table.add_column("ratio", justify="right")
        table.add_column("tandem", justify="left")
        judged = verdicts(figures, systems[best][cell]) if best else {}
        for key, (label, _) in FIGURES.items():
            row = [label] + [_fmt(systems.get(n, {}).get(cell, {}).get(key)) for n in names]
            ratio = figures.get(key) / systems[best][cell][key] if best and systems[best][cell].get(key) else None
            verdict = judged.get(key)
            row += [_fmt(ratio), "" if verdict is None else ("ahead" if verdict["ahead"] else "behind")]
            table.add_row(*row)
        offline = report.get("offline", {}).get(cell)
        for key, label, unit in (("output_throughput", "served / offline engine", "tok/s"),
                                 ("mean_ttft_ms", "TTFT served / offline", "ms"),
                                 ("median_tpot_ms", "TPOT served / offline", "ms")):
            if offline and offline.get(key) and figures.get(key):
                table.add_row(label, f"{figures[key] / offline[key]:.2f}", *[""] * (len(names) - 1), "",
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


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.1f}"
