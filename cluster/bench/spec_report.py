"""The result of ``tandem bench spec``: its JSON, built from the measured cells, and its rich tables,
printed from that JSON."""

from __future__ import annotations

import os
import platform
from dataclasses import asdict
from pathlib import Path

import torch
from rich import box
from rich.table import Table

from cluster.bench.spec_cells import ADAPTIVE_K, k_name

TANDEM_INVARIANT = "tandem-batch-invariant"  # the system name of cells measured with model.batch_invariant
TANDEM_REJECTION = "tandem-rejection"  # cells verified by rejection sampling (--verification both)


def print_tables(console, result: dict) -> None:
    def fmt(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    settings = result["settings"]
    model = Path(settings["model"]).name
    caption = ("speedup: tok/s over k=0 at the same batch; accept: accepted / drafted tokens; "
               "acc. len: tokens per drafting step (accepted + 1); tok/step: output tokens per target step, "
               f"steps without a draft included\nworkload: {settings['num_prompts']} prompts, {settings['workload']}; "
               f"prompts: {settings['prompt_format']}; prefix caching off")
    sections = (("tandem", result["tandem"]), (TANDEM_INVARIANT, result["tandem_batch_invariant"]),
                (TANDEM_REJECTION, result["tandem_rejection"]))
    for system, section in sections:
        if not section["cells"]:
            continue
        invariant = system == TANDEM_INVARIANT or result["tandem"]["batch_invariant"]
        title = (f"Tandem {settings['method']} speculation, {model} {settings['dtype']}, offline in-process"
                 + (", batch-invariant" if invariant else "")
                 + (", verified by rejection sampling" if system == TANDEM_REJECTION else "")
                 + (", coupled verification" if system == "tandem" and result["tandem_rejection"]["cells"]
                    else "") + f", {settings['sampling']}")
        table = Table(title=f"{title}, {settings['output_len']} tokens per request", caption=caption,
                      box=box.SIMPLE_HEAD, show_edge=False)
        # = k0: requests whose tokens equal plain decoding's
        for header in ("batch", "k", "tok/s", "TPOT ms", "TTFT ms", "accept", "acc. len", "tok/step", "speedup",
                       "= k0"):
            table.add_column(header, justify="right")
        last_batch = None
        for c in section["cells"]:
            if last_batch is not None and c["batch_size"] != last_batch:
                table.add_section()
            last_batch = c["batch_size"]
            same = c.get("identical_to_k0")
            table.add_row(str(c["batch_size"]), k_name(c["k"]), f"{c['tok_per_s']:.1f}", fmt(c["tpot_ms"], ".1f"),
                          f"{c['ttft_ms']:.0f}", fmt(c["acceptance_rate"], ".0%"),
                          fmt(c["mean_acceptance_length"], ".2f"), fmt(c["tokens_per_step"], ".2f"),
                          fmt(c["speedup_vs_k0"], ".2f"), "-" if same is None else f"{same}/{c['num_requests']}")
        console.print(table)
    if result["batch_invariant_cost"]:
        table = Table(title="What model.batch_invariant costs (same cells, one run)", box=box.SIMPLE_HEAD,
                      show_edge=False, caption="ratio: batch-invariant tok/s over usual tok/s; = k0: requests "
                      "whose greedy tokens equal plain decoding's at the same batch, each way")
        for header in ("batch", "k", "usual tok/s", "invariant tok/s", "ratio", "= k0 usual", "= k0 invariant"):
            table.add_column(header, justify="right")
        for row in result["batch_invariant_cost"]:
            n = row["num_requests"]
            table.add_row(str(row["batch_size"]), k_name(row["k"]), f"{row['usual_tok_per_s']:.1f}",
                          f"{row['invariant_tok_per_s']:.1f}", f"{row['invariant_over_usual']:.2f}",
                          f"{row['usual_identical_to_k0']}/{n}",
                          f"{row['invariant_identical_to_k0']}/{n}")
        console.print(table)
    if result["verification_cost"]:
        table = Table(title="Coupled verification against rejection sampling (same cells, one run)",
                      box=box.SIMPLE_HEAD, show_edge=False,
                      caption="ratio: coupled tok/s over rejection sampling's; = k0: requests whose tokens equal "
                      "plain decoding's (same seed) at the same batch, each way")
        for header in ("batch", "k", "coupled tok/s", "rejection tok/s", "ratio", "accept coupled",
                       "accept rejection", "= k0 coupled", "= k0 rejection"):
            table.add_column(header, justify="right")
        for row in result["verification_cost"]:
            n = row["num_requests"]
            percent = lambda v: "-" if v is None else f"{v:.0%}"  # noqa: E731
            table.add_row(str(row["batch_size"]), k_name(row["k"]), f"{row['coupled_tok_per_s']:.1f}",
                          f"{row['rejection_tok_per_s']:.1f}", f"{row['coupled_over_rejection']:.2f}",
                          percent(row["coupled_acceptance_rate"]), percent(row["rejection_acceptance_rate"]),
                          f"{row['coupled_identical_to_k0']}/{n}", f"{row['rejection_identical_to_k0']}/{n}")
        console.print(table)


def _with_speedups(cells: list) -> list[dict]:
    """Cells ordered by (batch size, k), the adaptive controller's last, each with its tok/s over
    k = 0 at the same batch size."""
    base = {(c.system, c.batch_size): c.tok_per_s for c in cells if c.k == 0}
    cells = sorted(cells, key=lambda c: (c.batch_size, c.k == ADAPTIVE_K, c.k))
    return [asdict(c) | {"speedup_vs_k0": (c.tok_per_s / base[(c.system, c.batch_size)]
                                           if (c.system, c.batch_size) in base else None)} for c in cells]


def build_result(args, source, load_average, prompt_ids, prompt_format, cells: list, workload: str,
                 warmup_len: int) -> dict:
    """The JSON of one run: machine, settings, each engine's cells, the side-by-side comparisons."""
    invariant = [c for c in cells if c.system == TANDEM_INVARIANT]
    rejection = [c for c in cells if c.system == TANDEM_REJECTION]
    usual = [c for c in cells if c.system == "tandem"]
    return {
        "machine": {"cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "torch_version": torch.__version__, "threads": torch.get_num_threads(),
                    "load_average_1_5_15m": load_average},
        "settings": {"model": args.model, "model_path": str(source.path), "method": args.method,
                     "draft_model": args.draft_model, "dtype": args.dtype, "batch_sizes": args.batch_sizes,
                     "ks": args.ks, "output_len": args.output_len, "num_prompts": args.num_prompts,
                     "prompt_format": prompt_format, "prompt_lens": [len(p) for p in prompt_ids],
                     "workload": workload, "warmup_len": warmup_len, "prefix_caching": False,
                     "sampling": (f"temperature {args.temperature}, seed = prompt index, ignore_eos"
                                  if args.temperature > 0 else "greedy, ignore_eos"),
                     "verification": args.verification, "concurrency": "closed loop, = batch size",
                     "tpot": "per request (last token time - first token time) / (output tokens - 1), mean",
                     "quantization": args.quantization, "draft_quantization": args.draft_quantization,
                     "kv_cache_dtype": args.kv_cache_dtype, "batch_invariant": args.batch_invariant,
                     "repeats": args.repeats, "warm_tree": args.warm_tree,
                     "ngram_draft_per_match_token": args.ngram_draft_per_match_token if args.method == "ngram"
                     else None},
        "tandem": {"mode": "offline, in-process engine", "batch_invariant": not usual or args.batch_invariant == "on",
                   "cells": _with_speedups(usual or invariant)},
        "tandem_batch_invariant": {"mode": "offline, in-process engine, model.batch_invariant",
                                   "cells": _with_speedups(invariant) if usual else []},
        "batch_invariant_cost": _invariant_cost(usual, invariant),
        "tandem_rejection": {"mode": "offline, in-process engine, verification: rejection",
                             "cells": _with_speedups(rejection)},
        "verification_cost": _verification_cost(usual, rejection),
    }


def _invariant_cost(usual: list, invariant: list) -> list[dict]:
    """Cells are ``SpecCell``s. Per (batch size, k) measured both ways: the batch-invariant engine's tok/s over the
    usual one's, and how many requests equal plain decoding's greedy tokens in each."""
    theirs = {(c.batch_size, c.k): c for c in invariant}
    return [{"batch_size": u.batch_size, "k": u.k, "usual_tok_per_s": u.tok_per_s,
             "invariant_tok_per_s": i.tok_per_s, "invariant_over_usual": i.tok_per_s / u.tok_per_s,
             "usual_identical_to_k0": u.identical_to_k0,
             "invariant_identical_to_k0": i.identical_to_k0, "num_requests": u.num_requests}
            for u in sorted(usual, key=lambda c: (c.batch_size, c.k)) for i in [theirs.get((u.batch_size, u.k))]
            if i is not None]


def _verification_cost(coupled: list, rejection: list) -> list[dict]:
    """Per (batch size, k) measured both ways (``--verification both``): acceptance and tok/s
    coupled and by rejection sampling, and how many requests keep k = 0's text in each."""
    theirs = {(c.batch_size, c.k): c for c in rejection}
    return [{"batch_size": c.batch_size, "k": c.k, "coupled_tok_per_s": c.tok_per_s,
             "rejection_tok_per_s": r.tok_per_s, "coupled_over_rejection": c.tok_per_s / r.tok_per_s,
             "coupled_acceptance_rate": c.acceptance_rate, "rejection_acceptance_rate": r.acceptance_rate,
             "coupled_identical_to_k0": c.identical_to_k0, "rejection_identical_to_k0": r.identical_to_k0,
             "num_requests": c.num_requests}
            for c in sorted(coupled, key=lambda c: (c.batch_size, c.k)) for r in [theirs.get((c.batch_size, c.k))]
            if r is not None]
