"""The rich tables of ``tandem bench spec``, printed from its JSON."""

from __future__ import annotations

from pathlib import Path

from cluster.bench.spec import TANDEM_INVARIANT, WORKLOAD


def print_tables(console, result: dict) -> None:
    from rich import box
    from rich.table import Table

    def fmt(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    settings = result["settings"]
    model = Path(settings["model"]).name
    caption = ("speedup: tok/s over k=0 at the same batch; accept: accepted / drafted tokens; "
               "acc. len: tokens per drafting step (accepted + 1); tok/step: output tokens per target step, "
               f"steps without a draft included\nworkload: {settings['num_prompts']} prompts, {WORKLOAD}; "
               f"prompts: {settings['prompt_format']}; prefix caching off")
    ours = {(c["batch_size"], c["k"]): c for c in result["tandem"]["cells"]}
    sections = (("tandem", result["tandem"]), (TANDEM_INVARIANT, result["tandem_batch_invariant"]),
                ("vllm", result["vllm"]))
    for system, section in sections:
        if not section["cells"]:
            continue
        is_tandem = system != "vllm"
        if is_tandem:
            invariant = system == TANDEM_INVARIANT or result["tandem"]["batch_invariant"]
            title = (f"Tandem {settings['method']} speculation, {model} {settings['dtype']}, offline in-process"
                     + (", batch-invariant" if invariant else ""))
        else:
            title = (f"vLLM CPU server, n-gram speculation, {model} {settings['dtype']}, over HTTP "
                     "(streaming /v1/completions, HTTP overhead included)")
        table = Table(title=f"{title}, {settings['output_len']} tokens per request",
                      caption=caption if is_tandem else "T/vLLM: Tandem's offline tok/s over vLLM's at the same "
                      "batch and k; vLLM n-gram prompt lookup n = 1..4, prefix caching off",
                      box=box.SIMPLE_HEAD, show_edge=False)
        headers = ["batch", "k", "tok/s", "TPOT ms", "TTFT ms", "accept", "acc. len",
                   "tok/step" if is_tandem else "T/vLLM", "speedup"]
        if is_tandem:
            headers.append("= k0")  # requests whose greedy tokens equal plain decoding's
        for header in headers:
            table.add_column(header, justify="right")
        last_batch = None
        for c in section["cells"]:
            if last_batch is not None and c["batch_size"] != last_batch:
                table.add_section()
            last_batch = c["batch_size"]
            if is_tandem:
                extra = fmt(c["tokens_per_step"], ".2f")
            else:
                t = ours.get((c["batch_size"], c["k"]))
                extra = fmt(t["tok_per_s"] / c["tok_per_s"] if t else None, ".2f")
            row = [str(c["batch_size"]), str(c["k"]), f"{c['tok_per_s']:.1f}", fmt(c["tpot_ms"], ".1f"),
                   f"{c['ttft_ms']:.0f}", fmt(c["acceptance_rate"], ".0%"),
                   fmt(c["mean_acceptance_length"], ".2f"), extra, fmt(c["speedup_vs_k0"], ".2f")]
            if is_tandem:
                same = c.get("greedy_identical_to_k0")
                row.append("-" if same is None else f"{same}/{c['num_requests']}")
            table.add_row(*row)
        console.print(table)
    if result["batch_invariant_cost"]:
        table = Table(title="What model.batch_invariant costs (same cells, one run)", box=box.SIMPLE_HEAD,
                      show_edge=False, caption="ratio: batch-invariant tok/s over usual tok/s; = k0: requests "
                      "whose greedy tokens equal plain decoding's at the same batch, each way")
        for header in ("batch", "k", "usual tok/s", "invariant tok/s", "ratio", "= k0 usual", "= k0 invariant"):
            table.add_column(header, justify="right")
        for row in result["batch_invariant_cost"]:
            n = row["num_requests"]
            table.add_row(str(row["batch_size"]), str(row["k"]), f"{row['usual_tok_per_s']:.1f}",
                          f"{row['invariant_tok_per_s']:.1f}", f"{row['invariant_over_usual']:.2f}",
                          f"{row['usual_greedy_identical_to_k0']}/{n}",
                          f"{row['invariant_greedy_identical_to_k0']}/{n}")
        console.print(table)
