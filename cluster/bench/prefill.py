"""``tandem bench prefill``: what a prompt's prefill takes, by length and cached prefix, with the
compiled prefill attention (``cluster/kernels/prefill_attention.cpp``) against torch's SDPA.

One engine (no speculation, prefix caching on, chunked prefill at ``--max-num-batched-tokens``).
A case is (cached prefix tokens, new tokens) of seeded random token ids: the prefix, where there is
one, is served first (untimed) so that the timed request finds it cached; the timed request asks
for one token and runs from ``add_request`` to the step that returns it, alone on the engine. Both
attention paths run every case in turn, round after round, on the same engine (SDPA by taking the
kernel off every attention layer), so a burst of load elsewhere hits both; each round's prompts
are new. Reported: each path's best and median over ``--rounds``, and SDPA / kernel of the bests.
Where the engine did not attach the kernel (no AVX-512, float32, ``TANDEM_PREFILL_KERNEL=0``, or its
probe found SDPA faster), the result says so and only SDPA is measured.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics

import torch
from rich import box
from rich.console import Console
from rich.table import Table

from cluster.bench.args import positive_int
from cluster.bench.benchmark import Benchmark
from cluster.bench.offline import DTYPES, concrete_dtype
from cluster.bench.prefix import time_to_first_token
from cluster.engine.llm import LLM
from cluster.models.layers.attention import PagedAttention
from cluster.models.loader import resolve_model
from cluster.shared.cpu_info import cpu_flags

DEFAULT_CASES = "0+128,0+512,0+1731,1008+731,2000+600,0+4000"


def _cases(text: str) -> list[tuple[int, int]]:
    cases = []
    for part in text.split(","):
        prefix, _, new = part.strip().partition("+")
        if not (prefix.isdigit() and new.isdigit() and int(new) > 0):
            raise argparse.ArgumentTypeError(f"expected cases like 0+128,1008+731 (cached + new tokens), got {part!r}")
        cases.append((int(prefix), int(new)))
    return cases


def add_prefill_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct", help="short name, HF folder or .gguf file")
    parser.add_argument("--dtype", choices=(*DTYPES, "auto"), default="auto",
                        help="auto: bfloat16 where the device computes it natively, else float32")
    parser.add_argument("--cases", type=_cases, default=_cases(DEFAULT_CASES),
                        help=f"cached prefix + new tokens per case (default {DEFAULT_CASES})")
    parser.add_argument("--rounds", type=positive_int, default=3, help="timed requests per case and path")
    parser.add_argument("--threads", type=positive_int, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=2048,
                        help="the engine's chunked-prefill budget per step")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="the engine's KV cache budget")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default="auto",
                        help="the engine's K/V dtype (auto: the compute dtype); both paths read it")
    parser.add_argument("--seed", type=int, default=0)


def measure_prefill(args: argparse.Namespace, console: Console) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    load_average = os.getloadavg()
    source = resolve_model(args.model)
    args.dtype = concrete_dtype(args.dtype, source)
    longest = max(prefix + new for prefix, new in args.cases)
    llm = LLM(str(source.path), dtype=args.dtype, device="cpu", enable_prefix_caching=True,
              kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype, max_model_len=longest + 1,
              max_num_batched_tokens=args.max_num_batched_tokens)
    engine = llm.engine
    layers = [m for m in engine.worker.runner.model.modules() if isinstance(m, PagedAttention)]
    kernels = {layer.cpu_prefill for layer in layers}
    kernel = next(iter(kernels)) if len(kernels) == 1 else None
    paths = {"sdpa": None, "kernel": kernel} if kernel is not None else {"sdpa": None}
    rng = random.Random(args.seed)
    low = min(1000, engine.vocab_size // 4)  # past the special and byte tokens of a real vocabulary

    def tokens(n: int) -> list[int]:
        return [rng.randrange(low, engine.vocab_size) for _ in range(n)]

    time_to_first_token(engine, tokens(min(256, longest)), "warm-up")  # first-call costs stay out of the timings
    seconds = {(case, path): [] for case in args.cases for path in paths}
    for round_ in range(args.rounds):
        for case in args.cases:
            prefix, new = case
            for path, attached in paths.items():
                console.print(f"round {round_ + 1}/{args.rounds}: {prefix} cached + {new} new, {path}")
                for layer in layers:
                    layer.cpu_prefill = attached
                head = tokens(prefix)
                if prefix:
                    time_to_first_token(engine, head + tokens(1), "prefix")  # cached from here on (whole blocks)
                seconds[(case, path)].append(time_to_first_token(engine, head + tokens(new), path).ttft_s)
    for layer in layers:
        layer.cpu_prefill = kernel
    rows = []
    for case in args.cases:
        row = {"cached_tokens": case[0], "new_tokens": case[1]}
        for path in paths:
            row[f"{path}_best_ms"] = round(min(seconds[(case, path)]) * 1e3, 1)
            row[f"{path}_median_ms"] = round(statistics.median(seconds[(case, path)]) * 1e3, 1)
            row[f"{path}_ms"] = [round(s * 1e3, 1) for s in seconds[(case, path)]]
        if kernel is not None:
            row["sdpa_over_kernel"] = round(row["sdpa_best_ms"] / row["kernel_best_ms"], 3)
        rows.append(row)
    return {
        "model": str(source.path), "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
        "threads": torch.get_num_threads(),
        "cpu_flags": " ".join(f for f in cpu_flags().split() if f.startswith(("avx512", "amx", "avx2"))),
        "kernel_attached": kernel is not None, "rounds": args.rounds,
        "max_num_batched_tokens": args.max_num_batched_tokens, "load_average_before": load_average, "cases": rows,
    }


def print_prefill(console: Console, result: dict) -> None:
    kernel = result["kernel_attached"]
    kv = result.get("kv_cache_dtype", "auto")
    table = Table(title=f"prefill alone, {result['dtype']}{'' if kv == 'auto' else f' ({kv} K/V)'}, "
                        f"{result['threads']} threads, best (median) of "
                        f"{result['rounds']}, ms", box=box.SIMPLE)
    for column in ("cached", "new", "SDPA", *(("kernel", "SDPA / kernel") if kernel else ())):
        table.add_column(column, justify="right")
    for row in result["cases"]:
        cells = [str(row["cached_tokens"]), str(row["new_tokens"]),
                 f"{row['sdpa_best_ms']:.1f} ({row['sdpa_median_ms']:.1f})"]
        if kernel:
            cells += [f"{row['kernel_best_ms']:.1f} ({row['kernel_median_ms']:.1f})", f"{row['sdpa_over_kernel']:.2f}x"]
        table.add_row(*cells)
    console.print(table)
    if not kernel:
        console.print("the prefill attention kernel is not attached here (no AVX-512, float32, "
                      "TANDEM_PREFILL_KERNEL=0, or SDPA probed faster): SDPA only")


PREFILL = Benchmark("prefill", "prefill time by prompt length and cached prefix: the prefill attention kernel "
                               "against SDPA", add_prefill_args, measure_prefill, print_prefill)
