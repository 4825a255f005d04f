"""``tandem bench lora``: what serving LoRA adapters costs, Tandem next to vLLM.

Offline batch generation (greedy, EOS ignored, the prompts of ``tandem bench offline``), at
each batch size three workloads: every request on the base model (``base``), every request
on one adapter (``one``), and requests spread round-robin over ``--num-adapters`` adapters
(``mixed``). The adapters are random rank-``--rank`` LoRA weights on all seven projections of
the Llama family, written as PEFT saves them (``write_random_adapter``), so both systems load
the same files. vLLM runs ``LLM.generate`` with a ``LoRARequest`` per request in its own
environment (``offline_vllm.VllmRunner``: the same threads on every core). Each cell: one
short warm-up, then the best of ``--repeats`` timed runs. Reported: output tok/s, each
workload over its system's ``base`` (the cost of adapters), Tandem over vLLM, and how many
requests' greedy tokens the two systems agree on (rounding may split a near tie).

``--max-loras N`` (fewer than ``--num-adapters``) serves the adapters on demand instead: Tandem
from a ``model.lora_dir`` holding them with ``model.max_loras`` N, vLLM with ``max_loras`` and
``max_cpu_loras`` N; the ``mixed`` workload then has requests wait for room and adapters loaded
again and again, and measures what that swapping costs each system.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich import box
from rich.console import Console
from rich.table import Table
from safetensors.torch import save_file

from cluster.bench.args import int_list, positive_int, timed
from cluster.bench.benchmark import Benchmark
from cluster.bench.offline import PROMPTS, WARMUP_LEN
from cluster.bench.offline_vllm import DEFAULT_VLLM_PYTHON, VllmRunner
from cluster.engine.llm import LLM
from cluster.models.loader import load_hf_config, load_tokenizer, resolve_model
from cluster.models.lora import TARGETS, projection_shape
from cluster.shared.sampling_params import SamplingParams

WORKLOADS = ("base", "one", "mixed")


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a Llama-family model")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 8, 32])
    parser.add_argument("--output-len", type=positive_int, default=64)
    parser.add_argument("--rank", type=positive_int, default=16)
    parser.add_argument("--num-adapters", type=positive_int, default=4)
    parser.add_argument("--max-loras", type=positive_int,
                        help="adapters held at once, loaded on demand (default: every adapter, loaded at start)")
    parser.add_argument("--repeats", type=positive_int, default=2)
    parser.add_argument("--systems", default="tandem,vllm", type=lambda t: [s for s in t.split(",") if s],
                        help="tandem and/or vllm")
    parser.add_argument("--vllm-python", type=Path, help="python of vLLM's environment (default: the vLLM tier's)")


def write_random_adapter(folder: Path, hf_config, rank: int, seed: int) -> Path:
    """A LoRA adapter of ``hf_config``'s model with random A and B on every target, as PEFT saves one."""
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for module in TARGETS:
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            fan_in, fan_out = projection_shape(hf_config, module)
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) / fan_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.02
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
                "lora_dropout": 0.0, "target_modules": list(TARGETS), "bias": "none", "use_rslora": False,
                "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
                "base_model_name_or_path": None}
    (folder / "adapter_config.json").write_text(json.dumps(settings, indent=2))
    return folder


@dataclass
class Cell:
    system: str
    workload: str
    batch_size: int
    output_tokens: int
    seconds: float
    tok_per_s: float


class _TandemLoRA:
    def __init__(self, model: str, dtype: str, max_num_seqs: int, adapters: dict[str, str], rank: int,
                 lora_dir: str | None = None, max_loras: int | None = None) -> None:
        """``max_loras``: serve the adapters from ``lora_dir`` on demand, that many at once."""
        where = dict(lora_dir=lora_dir, max_loras=max_loras) if max_loras else dict(lora_modules=adapters)
        self.llm = LLM(model, dtype=dtype, max_num_seqs=max_num_seqs, kv_cache_memory="2GiB", max_lora_rank=rank,
                       **where)
        self.last_token_ids: list[list[int]] = []

    def generate(self, prompt_ids: list[list[int]], output_len: int, adapters: list[str | None]) -> int:
        params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
        outs = self.llm.generate(prompt_ids, params, lora=adapters)
        self.last_token_ids = [o.outputs[0].token_ids for o in outs]
        return sum(map(len, self.last_token_ids))

    def close(self) -> None:
        self.llm.engine.worker.close()


def _assignments(workload: str, batch_size: int, names: list[str]) -> list[str | None]:
    if workload == "base":
        return [None] * batch_size
    if workload == "one":
        return [names[0]] * batch_size
    return [names[i % len(names)] for i in range(batch_size)]


def measure_lora(args: argparse.Namespace, console: Console) -> dict:
    """Every system at every batch size and adapter workload; returns the JSON result."""
    source = resolve_model(args.model)
    hf_config = load_hf_config(source)
    prompt_ids = load_tokenizer(source)(PROMPTS)["input_ids"]
    cells: list[Cell] = []
    tokens: dict[tuple[str, str, int], list[list[int]]] = {}
    with tempfile.TemporaryDirectory(prefix="tandem-lora-") as tmp:
        adapters = {f"adapter-{i}": str(write_random_adapter(Path(tmp) / f"adapter-{i}", hf_config, args.rank, i))
                    for i in range(args.num_adapters)}
        names = list(adapters)
        for system in args.systems:
            console.print(f"loading {system} with {len(adapters)} adapters of rank {args.rank}")
            if system == "tandem":
                runner = _TandemLoRA(str(source.path), args.dtype, max(args.batch_sizes), adapters, args.rank, tmp,
                                     args.max_loras)
            elif system == "vllm":
                runner = VllmRunner(args.vllm_python or DEFAULT_VLLM_PYTHON, source.path, args.dtype,
                                    max(args.batch_sizes), torch.get_num_threads(), lora_modules=adapters,
                                    max_lora_rank=args.rank, max_loras=args.max_loras)
            else:
                raise SystemExit(f"--systems: unknown system {system!r} (tandem, vllm)")
            try:
                for batch_size in args.batch_sizes:
                    batch = [prompt_ids[i % len(prompt_ids)] for i in range(batch_size)]
                    for workload in WORKLOADS:
                        assigned = _assignments(workload, batch_size, names)
                        runner.generate(batch, min(WARMUP_LEN, args.output_len), assigned)
                        runs = [timed(runner.generate, batch, args.output_len, assigned) for _ in range(args.repeats)]
                        produced, seconds = min(runs, key=lambda run: run[1])
                        if produced != batch_size * args.output_len:
                            raise RuntimeError(f"{system} produced {produced} tokens, expected "
                                               f"{batch_size} x {args.output_len}")
                        cells.append(Cell(system, workload, batch_size, produced, seconds, produced / seconds))
                        tokens[(system, workload, batch_size)] = runner.last_token_ids
                        console.print(f"  {system} {workload} batch {batch_size}: {produced / seconds:.1f} tok/s")
            finally:
                runner.close()
    return _result(args, cells, tokens)


def _result(args, cells: list[Cell], tokens: dict) -> dict:
    rate = {(c.system, c.workload, c.batch_size): c.tok_per_s for c in cells}
    rows = []
    for batch_size in args.batch_sizes:
        for workload in WORKLOADS:
            row = {"batch_size": batch_size, "workload": workload}
            for system in args.systems:
                row[system] = rate[(system, workload, batch_size)]
                row[f"{system}_over_base"] = row[system] / rate[(system, "base", batch_size)]
            if {"tandem", "vllm"} <= set(args.systems):
                row["tandem_over_vllm"] = row["tandem"] / row["vllm"]
                pairs = list(zip(tokens[("tandem", workload, batch_size)], tokens[("vllm", workload, batch_size)]))
                row["same_tokens"] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
            rows.append(row)
    return {"model": args.model, "dtype": args.dtype, "rank": args.rank, "num_adapters": args.num_adapters,
            "max_loras": args.max_loras,
            "output_len": args.output_len, "threads": torch.get_num_threads(), "repeats": args.repeats,
            "systems": args.systems, "rows": rows, "cells": [asdict(c) for c in cells]}


def print_lora(console: Console, result: dict) -> None:
    systems = result["systems"]
    both = {"tandem", "vllm"} <= set(systems)
    held = f", {result['max_loras']} held at once (on demand)" if result["max_loras"] else ""
    table = Table(title=f"LoRA: {result['num_adapters']} adapters of rank {result['rank']} on every projection"
                        f"{held}, {result['dtype']}, {result['output_len']} tokens, output tok/s", box=box.SIMPLE)
    table.add_column("batch", justify="right")
    table.add_column("workload")
    for system in systems:
        table.add_column(system, justify="right")
        table.add_column(f"{system} / base", justify="right")
    if both:
        table.add_column("Tandem / vLLM", justify="right")
        table.add_column("same tokens", justify="right")
    for row in result["rows"]:
        cells = [str(row["batch_size"]), row["workload"]]
        for system in systems:
            cells += [f"{row[system]:.1f}", f"{row[f'{system}_over_base']:.2f}"]
        if both:
            cells += [f"{row['tandem_over_vllm']:.2f}", row["same_tokens"]]
        table.add_row(*cells)
    console.print(table)


LORA = Benchmark("lora", "what LoRA adapters cost: one and several adapters against the base model, vLLM as a peer",
                 add_lora_args, measure_lora, print_lora)
