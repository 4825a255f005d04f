"""``tandem bench offline``: output tok/s of offline batch generation, Tandem next to its peers.

The peers are Hugging Face ``transformers.generate``, vLLM's ``LLM.generate`` (in its own
environment, see :mod:`cluster.bench.offline_vllm`) and, with ``--llamacpp``, llama.cpp's
``llama-bench`` at batch 1 beside Tandem on the GGUF file's own blocks (system ``tandem-gguf``,
``model.quantization: gguf``; :mod:`cluster.bench.llama_bench`). All systems get the same prompt token ids (the model's tokenizer applied once to
:data:`PROMPTS`), generate exactly ``output_len`` greedy tokens per request (EOS
ignored), and run on the same weights in the same process, one model at a time.
Every (system, dtype, batch size) cell has one short untimed warm-up, then the best
of ``repeats`` timed runs. The batch-1 rows are set against the memory-bandwidth
bound: measured read bandwidth / bytes of weights read per token. Heavy imports
are inside functions: ``tandem`` builds this parser for every command.
"""

from __future__ import annotations

import argparse
import gc
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich import box
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from cluster.bench.args import int_list, positive_int, timed
from cluster.bench.benchmark import Benchmark
from cluster.bench.servers import DEFAULT_ANCHOR
from cluster.bench.llama_bench import llama_bench_inputs, llamacpp_beside, print_llamacpp_table
from cluster.bench.offline_vllm import DEFAULT_VLLM_PYTHON, VllmRunner
from cluster.engine.llm import LLM
from cluster.models.hf_folder import iter_weights
from cluster.models.loader import load_hf_config, load_tokenizer, resolve_model
from cluster.models.registry import resolve_dtype
from cluster.shared.sampling_params import SamplingParams

SYSTEMS = ("tandem", "tandem-gguf", "transformers", "vllm")
DTYPES = ("float32", "bfloat16", "float16")

WARMUP_LEN = 8
BANDWIDTH_BYTES = 512 << 20

PROMPTS = [
    "Explain why the sky looks blue on a clear afternoon.",
    "Write a short poem about a lighthouse keeper who spends the long winter alone, watching the grey sea.",
    "What are three good habits for keeping a small vegetable garden healthy?",
    "Describe how the gears on a bicycle help a rider climb a steep hill without getting too tired.",
    "Give me a simple recipe for a warm tomato soup with basil.",
    "Why do cats like to sleep in small cardboard boxes?",
    "Summarize the main causes of the French Revolution in a few sentences, for a student who is new to history.",
    "How does a refrigerator keep food cold without any ice inside it?",
    "Tell a bedtime story about a brave little turtle who wants to fly over the mountains with the birds.",
    "What is the difference between weather and climate?",
    "List some tips for writing a clear and friendly email to a new colleague.",
    "How do bees find their way back to the hive after collecting nectar from flowers that are far away?",
    "Explain what a prime number is to a ten year old child.",
    "Describe the smell of a forest right after a summer rainstorm.",
    "What should I pack for a three day hiking trip in the mountains if the nights are cold and it might rain?",
    "Why does bread rise when it is baked in a hot oven?",
    "Write a friendly note thanking a neighbor for watering my plants.",
    "How did people tell the time before mechanical clocks were invented, and how accurate were their methods?",
    "Explain how a rainbow forms when sunlight passes through raindrops.",
    "What are the rules of chess for moving a knight?",
    "Describe a busy morning market in a small coastal town, with the fishermen, the bakers and the flower sellers.",
    "Why is it important to drink enough water during a hot day?",
    "Give three reasons why reading books can improve your vocabulary.",
    "How does a compass needle always point toward the north, and what can make it point the wrong way?",
    "Write the opening lines of a mystery novel set on an old train.",
    "What makes the ocean taste salty while most rivers taste fresh?",
    "Explain how plants turn sunlight, air and water into their food, and why they need all three of them.",
    "Describe the life cycle of a butterfly from egg to adult.",
    "What are some fun games to play with friends on a rainy day?",
    "How do airplanes stay in the air even though they are so heavy?",
    "Suggest a calm routine for the last hour before going to sleep on a night before an important exam.",
    "Why do leaves change color and fall from the trees in autumn?",
]


@dataclass(frozen=True)
class Cell:
    """One measured (system, dtype, batch size): the best of the timed runs."""

    system: str
    dtype: str
    batch_size: int
    output_len: int
    output_tokens: int
    seconds: float
    tok_per_s: float
    num_steps: int | None = None  # engine steps of the best run (Tandem only)
    mean_step_ms: float | None = None


def concrete_dtype(name: str, source) -> str:
    """``name`` with 'auto' made concrete for the CPU these benchmarks run on, so results
    name the dtype they measured."""
    return str(resolve_dtype(name, load_hf_config(source), torch.device("cpu"))).removeprefix("torch.")


def _name_list(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        names = [s.strip() for s in text.split(",")]
        if not all(n in allowed for n in names):
            raise argparse.ArgumentTypeError(f"got {text!r}; allowed: a comma list of {', '.join(allowed)}")
        return names
    return parse


def add_offline_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct", help="short name, HF folder or .gguf file")
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 8, 32], help="comma list (default 1,8,32)")
    parser.add_argument("--output-len", type=positive_int, default=128, help="output tokens per request (EOS ignored)")
    parser.add_argument("--dtypes", type=_name_list(DTYPES), default=["float32", "bfloat16"])
    parser.add_argument("--systems", type=_name_list(SYSTEMS), default=["tandem", "transformers"],
                        help="comma list of tandem, tandem-gguf (the GGUF file's blocks), transformers, vllm "
                             "(default: tandem,transformers; vllm needs its own environment, see --vllm-python)")
    parser.add_argument("--vllm-python", type=Path, default=None,
                        help="python of an environment with vLLM's CPU build (default: the vLLM test tier's, "
                             "built by tests/vllm/make_env.sh)")
    parser.add_argument("--vllm-eager", action="store_true",
                        help="run vLLM with enforce_eager (starts faster; its default compiles the model)")
    parser.add_argument("--llamacpp", action="store_true",
                        help="also llama.cpp's llama-bench at batch 1 on the same GGUF file (after the anchor's "
                             "setup), beside tandem-gguf (added to --systems)")
    parser.add_argument("--llama-bench", type=Path, default=None,
                        help="the llama-bench binary (default: the one llamacpp_cpu.sh setup built)")
    parser.add_argument("--llamacpp-script", type=Path, default=DEFAULT_ANCHOR.with_name("llamacpp_cpu.sh"),
                        help="the llama.cpp anchor script, asked for the GGUF file")
    parser.add_argument("--repeats", type=positive_int, default=1, help="timed runs per cell; the best is reported")
    parser.add_argument("--threads", type=positive_int, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="Tandem's KV cache budget")
    parser.add_argument("--tp", type=positive_int, default=1,
                        help="also run Tandem with the target split over this many ranks (system tandem-tpN, "
                             "gloo worker processes on the CPU) and compare its step latency with TP=1")


class TandemRunner:
    """Tandem's offline engine on ``device``: one batch of prompts run to the end, greedy."""

    def __init__(self, model: str, dtype: str, max_num_seqs: int, kv_cache_memory: str, tp: int = 1,
                 device: str = "cpu", **settings) -> None:
        """``settings``: further engine settings (speculation, say), as ``LLM`` takes them."""
        # Each rank of a TP engine sets its own thread count; the bench keeps the one it was given.
        overrides = dict(tensor_parallel_size=tp, num_threads=torch.get_num_threads()) if tp > 1 else {}
        self.llm = LLM(model, dtype=dtype, device=device, max_num_seqs=max_num_seqs,
                       kv_cache_memory=kv_cache_memory, **overrides, **settings)
        self.num_steps = 0  # steps of the latest generate

    def generate(self, prompt_ids: list[list[int]], output_len: int) -> int:
        """Greedy, EOS ignored; returns the number of output tokens produced."""
        engine = self.llm.engine
        params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
        for ids in prompt_ids:
            engine.add_request(ids, params)
        produced, self.num_steps = 0, 0
        while engine.has_unfinished():
            produced += sum(len(out.outputs[0].delta_token_ids) for out in engine.step())
            self.num_steps += 1
        return produced

    def close(self) -> None:
        self.llm.engine.worker.close()


class TransformersRunner:
    """Hugging Face ``generate`` on ``device``, the prompts left-padded into one batch."""

    def __init__(self, path: Path, dtype: str, tokenizer, device: str = "cpu") -> None:
        # here, not at the top: transformers' model classes take a second or more to import, for this baseline only
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # its tqdm bars would tear through the rich progress bar
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(self.device).eval()
        self.tokenizer = tokenizer

    def generate(self, prompt_ids: list[list[int]], output_len: int) -> int:
        """Greedy, exactly ``output_len`` new tokens per prompt (EOS banned until then); returns
        their number once the device has finished computing them."""
        batch = self.tokenizer.pad({"input_ids": prompt_ids}, padding=True, return_tensors="pt").to(self.device)
        with torch.inference_mode():
            out = self.model.generate(
                **batch, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return out.shape[0] * (out.shape[1] - batch["input_ids"].shape[1])


def measure_read_bandwidth(repeats: int = 5) -> float:
    """GB/s of ``tensor.sum()`` over a 512 MiB float32 tensor, best of ``repeats``."""
    x = torch.ones(BANDWIDTH_BYTES // 4, dtype=torch.float32)
    x.sum()
    best = min(timed(x.sum)[1] for _ in range(repeats))
    del x
    return BANDWIDTH_BYTES / best / 1e9


def params_read_per_token(source) -> int:
    """Parameters read to decode one token: all stored weights (a tied head counts once),
    less the input embedding of an untied model (only one row of it is read)."""
    num_params = sum(t.numel() for _, t in iter_weights(source))
    config = load_hf_config(source)
    if not getattr(config, "tie_word_embeddings", True):
        num_params -= config.vocab_size * config.hidden_size
    return num_params


def _runner(args, system: str, source, dtype: str, tp: int, tokenizer):
    if system == "tandem-gguf":
        return TandemRunner(str(source.path), dtype, max(args.batch_sizes), args.kv_cache_memory,
                            quantization="gguf")
    if system.startswith("tandem"):
        return TandemRunner(str(source.path), dtype, max(args.batch_sizes), args.kv_cache_memory, tp)
    if system == "vllm":
        return VllmRunner(args.vllm_python or DEFAULT_VLLM_PYTHON, source.path, dtype, max(args.batch_sizes),
                          torch.get_num_threads(), eager=args.vllm_eager)
    return TransformersRunner(source.path, dtype, tokenizer)


def measure_cell(runner, system: str, dtype: str, prompt_ids: list[list[int]], output_len: int,
                 repeats: int) -> Cell:
    """One untimed warm-up, then the best of ``repeats`` timed runs; a run that produced other than
    ``len(prompt_ids) x output_len`` tokens raises RuntimeError."""
    batch_size = len(prompt_ids)
    runner.generate(prompt_ids, min(WARMUP_LEN, output_len))
    runs = [timed(runner.generate, prompt_ids, output_len) for _ in range(repeats)]
    output_tokens, seconds = min(runs, key=lambda run: run[1])
    if output_tokens != batch_size * output_len:
        raise RuntimeError(f"{system} produced {output_tokens} tokens, expected {batch_size} x {output_len}")
    steps = getattr(runner, "num_steps", None)  # the same for every greedy run of one batch
    return Cell(system, dtype, batch_size, output_len, output_tokens, seconds, output_tokens / seconds,
                steps, seconds / steps * 1e3 if steps else None)


def measure_offline(args: argparse.Namespace, console: Console) -> dict:
    """Measure every cell; returns the JSON result."""
    if args.llamacpp:  # the peer's binary and file first: a missing one fails before anything is loaded
        peer_binary, peer_gguf = llama_bench_inputs(args.llama_bench, args.llamacpp_script)
    if args.threads:
        torch.set_num_threads(args.threads)
    source = resolve_model(args.model)
    tokenizer = load_tokenizer(source)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    prompt_ids = tokenizer(PROMPTS)["input_ids"]
    bandwidth = measure_read_bandwidth()
    num_params = params_read_per_token(source)

    cells: list[Cell] = []
    if args.llamacpp and "tandem-gguf" not in args.systems:
        args.systems = [*args.systems, "tandem-gguf"]
    systems = list(args.systems) + ([f"tandem-tp{args.tp}"] if args.tp > 1 else [])
    with Progress(console=console) as progress:
        task = progress.add_task("cells", total=len(args.dtypes) * len(systems) * len(args.batch_sizes))
        for dtype in args.dtypes:
            for system in systems:
                progress.update(task, description=f"loading {system} {dtype}")
                tp = args.tp if system.startswith("tandem-tp") else 1
                runner = _runner(args, system, source, dtype, tp, tokenizer)
                for batch_size in args.batch_sizes:
                    progress.update(task, description=f"{system} {dtype} batch {batch_size}")
                    batch = [prompt_ids[i % len(prompt_ids)] for i in range(batch_size)]
                    cells.append(measure_cell(runner, system, dtype, batch, args.output_len, args.repeats))
                    progress.advance(task)
                if hasattr(runner, "close"):
                    runner.close()
                del runner
                gc.collect()

    result = _result(args, source, cells, bandwidth, num_params, prompt_ids)
    if args.llamacpp:
        ours = {c.dtype: c.tok_per_s for c in cells if c.system == "tandem-gguf" and c.batch_size == 1}
        result["llamacpp"] = llamacpp_beside(peer_binary, peer_gguf, args.output_len, args.repeats, ours, bandwidth)
    return result


def print_offline(console: Console, result: dict) -> None:
    _print_table(console, result)
    if result.get("llamacpp"):
        print_llamacpp_table(console, result["llamacpp"])
    if result["tensor_parallel"]:
        _print_tp_table(console, result, result["tensor_parallel"][0]["tp"])


def _result(args, source, cells: list[Cell], bandwidth: float, num_params: int, prompt_ids) -> dict:
    rate = {(c.system, c.dtype, c.batch_size): c.tok_per_s for c in cells}
    ratios = []
    for d in args.dtypes:
        for b in args.batch_sizes:
            ours = rate.get(("tandem", d, b))
            if ours is None:
                continue
            peers = {f"tandem_over_{p}": ours / rate[(p, d, b)] for p in ("transformers", "vllm") if (p, d, b) in rate}
            if peers:
                ratios.append({"dtype": d, "batch_size": b, **peers})
    bounds = []
    for d in args.dtypes:
        bytes_per_token = num_params * getattr(torch, d).itemsize
        bound = bandwidth * 1e9 / bytes_per_token
        entry = {"dtype": d, "bytes_per_token": bytes_per_token, "bound_tok_per_s": bound}
        for s in args.systems:  # tandem-gguf reads the file's blocks: its bound is in the llamacpp section
            if s != "tandem-gguf" and (s, d, 1) in rate:
                entry[f"{s}_batch1_fraction"] = rate[(s, d, 1)] / bound
        bounds.append(entry)
    return {
        "machine": {"cpu_count": os.cpu_count(), "torch_version": torch.__version__,
                    "threads": torch.get_num_threads(), "read_bandwidth_gb_s": bandwidth},
        "settings": {"model": args.model, "model_path": str(source.path), "systems": args.systems,
                     "dtypes": args.dtypes, "batch_sizes": args.batch_sizes, "output_len": args.output_len,
                     "repeats": args.repeats, "warmup_len": WARMUP_LEN, "num_params_per_token": num_params,
                     "prompt_lens": [len(p) for p in prompt_ids]},
        "cells": [asdict(c) for c in cells],
        "ratios": ratios,
        "bandwidth_bound": bounds,
        "tensor_parallel": _tp_ratios(args, cells),
    }


def _tp_ratios(args, cells: list[Cell]) -> list[dict]:
    """Mean step latency of TP=N over TP=1, per (dtype, batch size), from the same run."""
    if args.tp <= 1:
        return []
    step = {(c.system, c.dtype, c.batch_size): c.mean_step_ms for c in cells}
    out = []
    for d in args.dtypes:
        for b in args.batch_sizes:
            single, split = step.get(("tandem", d, b)), step.get((f"tandem-tp{args.tp}", d, b))
            if single and split:
                out.append({"dtype": d, "batch_size": b, "tp": args.tp, "tp1_step_ms": single,
                            "tp_step_ms": split, "tp_over_tp1_step_latency": split / single})
    return out


def _print_tp_table(console, result: dict, tp: int) -> None:
    table = Table(title=f"mean step latency, TP={tp} vs TP=1 (same run)", box=box.SIMPLE_HEAD, show_edge=False)
    for header in ("dtype", "batch", "TP=1 ms", f"TP={tp} ms", f"TP={tp}/TP=1"):
        table.add_column(header, justify="left" if header == "dtype" else "right")
    for row in result["tensor_parallel"]:
        table.add_row(row["dtype"], str(row["batch_size"]), f"{row['tp1_step_ms']:.2f}",
                      f"{row['tp_step_ms']:.2f}", f"{row['tp_over_tp1_step_latency']:.2f}")
    console.print(table)


def _print_table(console, result: dict) -> None:
    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    rate = {(c["system"], c["dtype"], c["batch_size"]): c["tok_per_s"] for c in result["cells"]}
    ratio = {(r["dtype"], r["batch_size"]): r for r in result["ratios"]}
    bound = {b["dtype"]: b for b in result["bandwidth_bound"]}
    machine, settings = result["machine"], result["settings"]
    table = Table(
        title=f"output tok/s, {Path(settings['model']).name}, {settings['output_len']} tokens per request",
        caption=f"bound: batch-1 tok/s at the read bandwidth ({machine['read_bandwidth_gb_s']:.1f} GB/s "
                f"measured, {machine['threads']} threads); HF = transformers, vLLM = vLLM's LLM.generate "
                f"(same threads, no core reserved: VLLM_CPU_NUM_OF_RESERVED_CPU=0)",
        box=box.SIMPLE_HEAD, show_edge=False,
    )
    for header in ("dtype", "batch", "Tandem", "HF", "vLLM", "Tandem/HF", "Tandem/vLLM", "bound", "Tandem/bound"):
        table.add_column(header, justify="left" if header == "dtype" else "right")
    for d in settings["dtypes"]:
        for b in settings["batch_sizes"]:
            at_1 = bound[d] if b == 1 else {}
            over = ratio.get((d, b), {})
            table.add_row(
                d, str(b), *(fmt(rate.get((s, d, b)), ".1f") for s in ("tandem", "transformers", "vllm")),
                fmt(over.get("tandem_over_transformers"), ".2f"), fmt(over.get("tandem_over_vllm"), ".2f"),
                fmt(at_1.get("bound_tok_per_s"), ".0f"), fmt(at_1.get("tandem_batch1_fraction"), ".0%"),
            )
    console.print(table)


OFFLINE = Benchmark("offline", "output tok/s at several batch sizes, Tandem vs transformers",
                    add_offline_args, measure_offline, print_offline)
