"""Measure a draft against its target: size, step time, acceptance per position.

    python -m cluster.drafts.evaluate --target smollm2-135m-instruct --draft PATH [--k 5] [--json PATH]

- size: the draft's own parameters (everything but the embedding it shares with the
  target) and all of them, with megabytes at 2 bytes (float16 storage) and 4 (float32);
- step time: one decode pass (1 new token per sequence at ``--context-len``) of the draft
  and of the target, at each batch size, through the engine's own runners; repeats are
  interleaved and the median kept, and the ratio is the figure to read (absolute times
  on a shared machine move a lot);
- acceptance per position: the conditional acceptance of draft position 1..k on the
  calibration prompts (:func:`cluster.profiling.profiler.measure_acceptance`, greedy).

Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from cluster.config import TandemConfig, with_overrides
from cluster.engine.engine import Engine
from cluster.models.hf_folder import iter_weights
from cluster.models.loader import resolve_model
from cluster.runner.input_batch import SeqChunk
from cluster.profiling.profiler import measure_acceptance


def draft_size(draft: str) -> dict:
    shapes = {name: t.numel() for name, t in iter_weights(resolve_model(draft))}
    own = sum(n for name, n in shapes.items() if name not in ("model.embed_tokens.weight", "lm_head.weight"))
    total = sum(shapes.values())
    return {"own_params": own, "total_params": total, "own_mb_float16": own * 2 / 1e6,
            "total_mb_float32": total * 4 / 1e6}


def step_times(engine: Engine, batch_size: int, context_len: int, repeats: int) -> dict:
    """Median seconds of one decode pass of target and draft for ``batch_size`` sequences."""
    manager = engine.block_manager
    ids = [f"__draft_eval_{i}" for i in range(batch_size)]
    for rid in ids:
        if not manager.allocate_slots(rid, 0, context_len + 1):
            raise ValueError(f"the KV cache cannot hold {batch_size} x {context_len} tokens")
    try:
        tables = [manager.get_block_table(rid) for rid in ids]
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(3, engine.worker.runner.model.vocab_size, (batch_size,), generator=gen).tolist()
        chunks = [SeqChunk([t], context_len, 1) for t in tokens]
        runners = {"target": engine.worker.runner, "draft": engine.proposer.runner}
        samples: dict[str, list[float]] = {name: [] for name in runners}
        with torch.inference_mode():
            for name, runner in runners.items():
                runner.forward_logits(chunks, tables)  # warm-up
            for _ in range(repeats):
                for name, runner in runners.items():
                    started = time.perf_counter()
                    runner.forward_logits(chunks, tables)
                    samples[name].append(time.perf_counter() - started)
    finally:
        for rid in ids:
            manager.free(rid)
    target, draft = statistics.median(samples["target"]), statistics.median(samples["draft"])
    return {"batch_size": batch_size, "target_s": target, "draft_s": draft, "draft_over_target": draft / target}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.drafts.evaluate", description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--draft", required=True, help="short name or HF folder of the draft")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--k", type=int, default=5, help="draft positions to measure acceptance for")
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--context-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    config = with_overrides(TandemConfig(), model=args.target, dtype=args.dtype, device="cpu", method="draft",
                            draft_model=args.draft, num_speculative_tokens=args.k, controller="fixed")
    engine = Engine(config)
    result = {"target": args.target, "draft": args.draft, "dtype": args.dtype, "size": draft_size(args.draft),
              "torch_threads": torch.get_num_threads()}
    result["step_times"] = [step_times(engine, int(b), args.context_len, args.repeats)
                            for b in args.batch_sizes.split(",")]
    result["acceptance_per_position"] = measure_acceptance(engine, args.k)
    _print(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def _print(result: dict) -> None:
    size = result["size"]
    table = Table(title=f"draft {result['draft']} vs target {result['target']} ({result['dtype']})")
    table.add_column("batch")
    table.add_column("target ms")
    table.add_column("draft ms")
    table.add_column("draft / target")
    for row in result["step_times"]:
        table.add_row(str(row["batch_size"]), f"{row['target_s'] * 1e3:.1f}", f"{row['draft_s'] * 1e3:.1f}",
                      f"{row['draft_over_target']:.2f}")
    console = Console()
    console.print(table)
    console.print(f"own params {size['own_params'] / 1e6:.1f} M ({size['own_mb_float16']:.1f} MB float16), "
                  f"total {size['total_params'] / 1e6:.1f} M ({size['total_mb_float32']:.0f} MB float32)")
    console.print("acceptance per position (calibration prompts, greedy): "
                  + ", ".join(f"{a:.2f}" for a in result["acceptance_per_position"]))


if __name__ == "__main__":
    raise SystemExit(main())
