"""Decode throughput of Tandem's engine against ``transformers.generate`` on the same device, and
of the same engine in its engine-core process (``tandem-core``: what ``tandem serve``'s replica
runs, every token streamed back to this process), so the hand-off's cost on the device shows.
Then Tandem speculating (n-gram, and the EAGLE-3 head, both under the adaptive controller)
against itself decoding plainly, and the step time of verify steps (the head at a fixed k = 4,
every step after the prompt's a verify step) against plain decode steps at the same batch size:
mean step times over the run, the prompt's steps in both.

Driven by ``tandem bench offline``'s own runners and cell (``cluster.bench.offline``): the same
prompt token ids for both (the bench's prompts through the model's tokenizer), exactly
``output_len`` greedy tokens per request (EOS ignored), one untimed warm-up per cell, then the
best of ``repeats`` timed runs; a cell whose system produced another number of tokens is an
error, not a figure. Output tok/s counts only generated tokens; prefill is inside the time.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import asdict
from pathlib import Path

from checks import release
from cluster.bench.offline import PROMPTS, TandemRunner, TransformersRunner, measure_cell
from cluster.config import TandemConfig, with_overrides
from cluster.shared.sampling_params import SamplingParams


class CoreRunner:
    """Tandem's engine in its engine-core process (``ProcessClient``), every prompt streamed at once."""

    def __init__(self, model: str, dtype: str, max_num_seqs: int, kv_cache_memory: str, device: str) -> None:
        from cluster.hosting.backend import BackendContext
        from cluster.hosting.process_client import ProcessClient
        from cluster.metrics.collector import MemorySink

        config = with_overrides(TandemConfig(), model=model, dtype=dtype, device=device, max_num_seqs=max_num_seqs,
                                kv_cache_memory=kv_cache_memory)
        self.backend = ProcessClient(config, config.serve.groups[0], BackendContext(metrics_sink=MemorySink()))
        self.ids = itertools.count()

    def generate(self, prompt_ids: list[list[int]], output_len: int) -> int:
        """Greedy, EOS ignored; returns the number of output tokens streamed back."""
        from cluster.hosting.protocol import GenerateRequest

        params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)

        async def one(ids: list[int]) -> int:
            tokens = 0
            async for delta in self.backend.generate(GenerateRequest(f"bench-{next(self.ids)}", ids, params)):
                if delta.error is not None:
                    raise RuntimeError(delta.error.message)
                tokens += len(delta.token_ids)
            return tokens

        async def run() -> int:
            return sum(await asyncio.gather(*(one(ids) for ids in prompt_ids)))

        return asyncio.run(run())

    def close(self) -> None:
        asyncio.run(self.backend.shutdown())


def prompt_ids_for(tokenizer) -> list[list[int]]:
    return tokenizer(PROMPTS)["input_ids"]


def speculation_systems(head: str, k: int = 4) -> dict[str, dict]:
    """The speculating systems of the table, by name: their engine settings."""
    return {"tandem+ngram": dict(method="ngram", num_speculative_tokens=k, controller="adaptive"),
            "tandem+eagle3": dict(method="eagle3", draft_model=head, num_speculative_tokens=k, controller="adaptive"),
            f"tandem+eagle3 k={k}": dict(method="eagle3", draft_model=head, num_speculative_tokens=k)}


def measure(model_dir: Path, tokenizer, device: str, dtype: str, batch_sizes: list[int], output_len: int,
            repeats: int, kv_cache_memory: str, head: str) -> dict:
    """Every (system, batch size) cell; Tandem's tok/s over transformers' and the core process's over
    the in-process engine's, per batch size; each speculating system's over plain Tandem's, and the
    fixed-k run's mean step time over plain Tandem's. ``head``: the EAGLE-3 head (folder or name)."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    prompt_ids = prompt_ids_for(tokenizer)
    systems = {
        "tandem": lambda: TandemRunner(str(model_dir), dtype, max(batch_sizes), kv_cache_memory, device=device),
        "tandem-core": lambda: CoreRunner(str(model_dir), dtype, max(batch_sizes), kv_cache_memory, device),
        "transformers": lambda: TransformersRunner(model_dir, dtype, tokenizer, device=device),
    }
    speculating = speculation_systems(head)
    for name, settings in speculating.items():
        systems[name] = lambda settings=settings: TandemRunner(str(model_dir), dtype, max(batch_sizes),
                                                               kv_cache_memory, device=device, **settings)
    cells = []
    for system, build in systems.items():
        runner = build()
        try:
            for batch_size in batch_sizes:
                batch = [prompt_ids[i % len(prompt_ids)] for i in range(batch_size)]
                cells.append(measure_cell(runner, system, dtype, batch, output_len, repeats))
        finally:
            if hasattr(runner, "close"):
                runner.close()
            del runner
            release()
    rate = {(c.system, c.batch_size): c.tok_per_s for c in cells}
    step_ms = {(c.system, c.batch_size): c.mean_step_ms for c in cells}
    fixed = list(speculating)[-1]
    ratios = [{"batch_size": b, "tandem_over_transformers": rate[("tandem", b)] / rate[("transformers", b)],
               "core_over_tandem": rate[("tandem-core", b)] / rate[("tandem", b)],
               **{f"{name}_over_tandem": rate[(name, b)] / rate[("tandem", b)] for name in speculating},
               "verify_step_over_decode_step": step_ms[(fixed, b)] / step_ms[("tandem", b)]} for b in batch_sizes]
    return {"dtype": dtype, "output_len": output_len, "repeats": repeats, "batch_sizes": batch_sizes,
            "prompt_lens": [len(p) for p in prompt_ids], "head": head, "speculating": list(speculating),
            "cells": [asdict(c) for c in cells], "ratios": ratios}


def format_table(result: dict) -> str:
    rate = {(c["system"], c["batch_size"]): c for c in result["cells"]}
    ratio = {r["batch_size"]: r for r in result["ratios"]}
    lines = [f"decode throughput, {result['model']} {result['dtype']} on {result['device']}, "
             f"{result['output_len']} greedy tokens per request (output tok/s, best of {result['repeats']})",
             f"{'batch':>6} {'Tandem':>10} {'HF':>10} {'Tandem/HF':>10} {'Tandem ms/step':>15} {'core':>10} "
             f"{'core/Tandem':>12}"]
    for b in result["batch_sizes"]:
        ours, theirs, core = rate[("tandem", b)], rate[("transformers", b)], rate[("tandem-core", b)]
        step = "-" if ours["mean_step_ms"] is None else f"{ours['mean_step_ms']:.2f}"
        lines.append(f"{b:>6} {ours['tok_per_s']:>10.1f} {theirs['tok_per_s']:>10.1f} "
                     f"{ratio[b]['tandem_over_transformers']:>10.2f} {step:>15} {core['tok_per_s']:>10.1f} "
                     f"{ratio[b]['core_over_tandem']:>12.2f}")
    names = result["speculating"]
    lines += ["", f"speculation against plain decoding (output tok/s over Tandem's; head {result['head']}); "
                  f"mean step time of {names[-1]} over plain decoding's",
              f"{'batch':>6} " + " ".join(f"{name:>22}" for name in names) + f" {'verify/decode step':>19}"]
    for b in result["batch_sizes"]:
        lines.append(f"{b:>6} " + " ".join(f"{ratio[b][name + '_over_tandem']:>22.2f}" for name in names)
                     + f" {ratio[b]['verify_step_over_decode_step']:>19.2f}")
    return "\n".join(lines)
