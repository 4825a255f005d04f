"""``tandem bench long-context``: what a decode or verify step costs as contexts grow, and how
much of it is reading K/V.

One engine per K/V dtype (``--kv-cache-dtypes``: ``auto`` is the model's dtype, ``int8`` the
int8 cache), from ``--config`` with the longest context's ``max_model_len``. A cell is (context,
batch, k): ``batch`` synthetic sequences of ``context`` tokens (block tables from the engine's
pool; their K/V is whatever the pool holds, which costs the same to read) each computing
``k + 1`` new tokens with logits at every one, as a verify step does (k = 0: a plain decode
step), through the engine's own runner. The cells of one (context, batch) run in turn, round
after round (``--repeats``), so a slow spell hits all of them; the median is kept.

Beside each step: the K/V a plain step reads (every sequence's context once, every layer) and
the time that takes at this machine's read speed (torch summing a 512 MiB tensor on the same
threads): the floor that K/V alone puts under a plain step. ``k=8 / k=0`` is what a verify step
of 8 drafts costs against a plain one at the same batch.

With ``--stall-caps``, also prompts beside decodes: per ``scheduler.max_prompt_tokens_beside_decodes``
(0: off), an engine (speculation and prefix caching off) with ``--stall-decodes`` requests decoding
at ``--stall-context`` tokens, then one ``--stall-prompt``-token prompt arrives; the engine is
stepped by hand until the prompt's first token, and each step is a wait every decoder had for its
next token. Reported: the longest and median wait, and the prompt's TTFT.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from rich import box
from rich.console import Console
from rich.table import Table

from cluster.bench.args import positive_int
from cluster.bench.benchmark import Benchmark
from cluster.bench.offline import measure_read_bandwidth
from cluster.config import load_config, with_overrides
from cluster.engine.engine import Engine
from cluster.profiling.profiler import SyntheticBatch, time_interleaved
from cluster.runner.input_batch import SeqChunk
from cluster.shared.sampling_params import SamplingParams
from cluster.shared.cpu_info import cpu_flags


def _ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def add_long_context_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="configs/local.yaml", help="the engine's settings (YAML)")
    parser.add_argument("--contexts", type=_ints, default=[512, 2048, 4096, 8000], help="context tokens per sequence")
    parser.add_argument("--batches", type=_ints, default=[1, 8, 16], help="sequences per step")
    parser.add_argument("--ks", type=_ints, default=[0, 3, 8], help="drafts verified per sequence (0: plain decode)")
    parser.add_argument("--kv-cache-dtypes", default="auto,int8", help="K/V dtypes to run (auto, int8)")
    parser.add_argument("--kv-cache-memory", default="6GiB",
                        help="the engine's KV pool: must hold the largest batch at the longest context")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed rounds per cell (median kept)")
    parser.add_argument("--threads", type=positive_int, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--skip-steps", action="store_true", help="measure only the prompts beside decodes")
    parser.add_argument("--stall-caps", type=_ints, default=[],
                        help="scheduler.max_prompt_tokens_beside_decodes values for the prompts-beside-decodes "
                             "part (0: off); none given: the part is skipped")
    parser.add_argument("--stall-decodes", type=positive_int, default=8, help="requests decoding meanwhile")
    parser.add_argument("--stall-context", type=positive_int, default=1000, help="their prompts' tokens")
    parser.add_argument("--stall-prompt", type=positive_int, default=4000, help="the arriving prompt's tokens")


def kv_bytes_per_token(engine: Engine) -> int:
    """K and V bytes one token of context takes over all layers."""
    spec = engine.worker.runner.spec
    return spec.bytes_per_block // spec.block_size


def measure_stalls(args: argparse.Namespace, console: Console) -> list[dict]:
    """Waits of running decodes while a long prompt comes in, per max_prompt_tokens_beside_decodes."""
    rows = []
    for cap in args.stall_caps:
        console.print(f"prompts beside decodes: max_prompt_tokens_beside_decodes {cap or 'off'}")
        config = with_overrides(load_config(args.config), method="none", enable_prefix_caching=False,
                                max_prompt_tokens_beside_decodes=cap, kv_cache_memory=args.kv_cache_memory,
                                max_model_len=max(args.stall_context + 256, args.stall_prompt + 1))
        engine = Engine(config)
        rng = random.Random(0)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(min(1000, engine.vocab_size // 4), engine.vocab_size) for _ in range(n)]

        try:
            params = SamplingParams(max_tokens=256, temperature=0, ignore_eos=True)
            decoders = [engine.add_request(tokens(args.stall_context), params) for _ in range(args.stall_decodes)]
            requests = engine.scheduler.requests
            while any(requests[r].num_output_tokens == 0 for r in decoders):
                engine.step()
            engine.step()  # every decoder in its decode steps
            prompt = engine.add_request(tokens(args.stall_prompt), SamplingParams(max_tokens=1, temperature=0))
            started = last = time.perf_counter()
            waits = []
            while prompt in requests and requests[prompt].num_output_tokens == 0:
                engine.step()
                now = time.perf_counter()
                waits.append(now - last)
                last = now
        finally:
            engine.worker.close()
        rows.append({"cap": cap, "ttft_s": round(last - started, 3), "steps": len(waits),
                     "longest_wait_ms": round(max(waits) * 1e3, 1),
                     "median_wait_ms": round(statistics.median(waits) * 1e3, 1)})
    return rows


def measure_long_context(args: argparse.Namespace, console: Console) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    speed = measure_read_bandwidth() * 1e9  # bytes a second
    longest = max(args.contexts) + max(args.ks) + 1
    rows = []
    for kv_dtype in [] if args.skip_steps else args.kv_cache_dtypes.split(","):
        config = with_overrides(load_config(args.config), kv_cache_dtype=kv_dtype, method="none",
                                max_model_len=longest, kv_cache_memory=args.kv_cache_memory)
        engine = Engine(config)
        runner = engine.worker.runner
        per_token = kv_bytes_per_token(engine)
        gen = torch.Generator().manual_seed(0)
        try:
            for context in args.contexts:
                for b in args.batches:
                    console.print(f"{kv_dtype} K/V: context {context}, batch {b}")
                    batch = SyntheticBatch(engine, b, context + max(args.ks) + 1)
                    try:
                        fns = []
                        for k in args.ks:
                            tokens = torch.randint(3, engine.vocab_size, (b, k + 1), generator=gen).tolist()
                            chunks = [SeqChunk(t, context, k + 1) for t in tokens]
                            fns.append(lambda chunks=chunks, tables=batch.tables: runner.forward_logits(chunks, tables))
                        seconds = time_interleaved(fns, args.repeats)
                    finally:
                        batch.close()
                    kv_bytes = b * context * per_token
                    rows.append({"kv_cache_dtype": kv_dtype,
                                 "compute_dtype": str(runner.spec.dtype).removeprefix("torch."),
                                 "context": context, "batch": b,
                                 "step_ms": {str(k): round(s * 1e3, 2) for k, s in zip(args.ks, seconds)},
                                 "kv_bytes_plain_step": kv_bytes, "kv_floor_ms": round(kv_bytes / speed * 1e3, 2)})
        finally:
            engine.worker.close()
    return {"config": args.config, "threads": torch.get_num_threads(), "read_speed_gbps": round(speed / 1e9, 1),
            "cpu_flags": " ".join(f for f in cpu_flags().split() if f.startswith(("avx512", "amx", "avx2"))),
            "ks": args.ks, "repeats": args.repeats, "rows": rows,
            "stalls": {"decodes": args.stall_decodes, "context": args.stall_context, "prompt": args.stall_prompt,
                       "rows": measure_stalls(args, console)}}


def print_long_context(console: Console, result: dict) -> None:
    ks = [str(k) for k in result["ks"]]
    table = Table(title=f"decode (k=0) and verify steps, ms: {result['threads']} threads, median of "
                        f"{result['repeats']}; K/V floor: a plain step's K/V at {result['read_speed_gbps']} GB/s",
                  box=box.SIMPLE)
    ratio = (f"k{ks[-1]}/k{ks[0]}",) if len(ks) > 1 else ()
    for column in ("K/V", "context", "batch", *(f"k={k}" for k in ks), "K/V MB", "floor", *ratio):
        table.add_column(column, justify="right")
    for row in result["rows"]:
        steps = [row["step_ms"][k] for k in ks]
        kv = row["kv_cache_dtype"] if row["kv_cache_dtype"] != "auto" else row["compute_dtype"]
        cells = [kv, str(row["context"]), str(row["batch"]), *(f"{s:.1f}" for s in steps),
                 f"{row['kv_bytes_plain_step'] / 1e6:.0f}", f"{row['kv_floor_ms']:.1f}"]
        if ratio:
            cells.append(f"{steps[-1] / steps[0]:.2f}x")
        table.add_row(*cells)
    if result["rows"]:
        console.print(table)
    stalls = result.get("stalls")
    if stalls and stalls["rows"]:
        table = Table(title=f"{stalls['decodes']} decodes at {stalls['context']} tokens while a "
                            f"{stalls['prompt']}-token prompt comes in", box=box.SIMPLE)
        for column in ("cap", "steps", "longest wait ms", "median wait ms", "prompt TTFT s"):
            table.add_column(column, justify="right")
        for row in stalls["rows"]:
            table.add_row(str(row["cap"] or "off"), str(row["steps"]), f"{row['longest_wait_ms']:.0f}",
                          f"{row['median_wait_ms']:.0f}", f"{row['ttft_s']:.2f}")
        console.print(table)


LONG_CONTEXT = Benchmark("long-context", "decode and verify step time by context, batch, k and K/V dtype, beside "
                                         "the K/V floor", add_long_context_args, measure_long_context,
                         print_long_context)
