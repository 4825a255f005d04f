"""``tandem bench quant``: int8 and 4-bit kernels, quality and decoding speed against full precision.

Three parts, one process, one model at a time, the model in ``--dtype`` (float32 by default):

1. **Kernels**: every linear shape of the model (fused QKV, O, fused gate/up, down, LM
   head) at several row counts, timed per call (median of ``--repeats`` after a
   warm-up): float32 ``F.linear``, the oneDNN-packed float32 layer the engine uses, and
   each quantized kernel (``int8pack`` fed bfloat16, widened weights, fbgemm's dynamic W8A8,
   and the compiled ``lowbit_gemm`` on int8 and 4-bit weights, fed ``--dtype`` activations).
   A "decode step" row adds the shapes up as one forward pass uses them.
2. **Quality** against the unquantized model (``full``, :mod:`cluster.bench.quant_quality`): top-1
   agreement on the calibration prompts' greedy continuations, perplexity change on
   the shipped text, for int8 and 4-bit weights, int8-dynamic, the int8 KV cache, and int8
   weights with the int8 KV cache.
3. **Engine**: output tok/s closed-loop at each batch size (greedy, EOS ignored), each
   configuration on the same prompts, with the ratio to ``full`` and the KV blocks the
   same memory budget holds.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from cluster.bench.args import int_list, positive_int
from cluster.bench.benchmark import Benchmark
from cluster.bench.quant_quality import PERPLEXITY_TEXT, compare, reference_of
from cluster.bench.spec import run_closed_loop
from cluster.engine.llm import LLM
from cluster.kernels.build import gguf_gemm, lowbit_gemm
from cluster.kernels.packed_linear import PackedLinear, can_pack
from cluster.models.gguf_blocks import block_format
from cluster.models.loader import load_hf_config, resolve_model
from cluster.profiling.calibration import CALIBRATION_PROMPTS
from cluster.profiling.edit_prompts import build_prompt_ids
from cluster.quant.gguf_linear import BlockPart, GGUFLinear
from cluster.quant.int4_linear import Int4Linear
from cluster.quant.int8_linear import Int8Linear, fbgemm_available, int8pack_dtype, quantize_weight
from cluster.shared.sampling_params import SamplingParams

CONFIGS = {  # name -> engine overrides
    "full": {},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
    "int8-dynamic": {"quantization": "int8-dynamic"},
    "kv-int8": {"kv_cache_dtype": "int8"},
    "int8+kv-int8": {"quantization": "int8", "kv_cache_dtype": "int8"},
    "gguf": {"quantization": "gguf"},  # the GGUF file's own blocks (a .gguf model or the embedded one)
    "gguf-int8": {"quantization": "gguf", "gguf_activations": "int8"},  # the same, 8-bit activations alone
}
# Configurations whose decode steps compute otherwise than their prompts: compared as decoding runs.
STEPWISE = {"gguf", "gguf-int8"}
KERNELS = ("float32", "float32-packed", "int8pack-bf16", "int8-widened", "int8-dynamic-fbgemm", "int8-lowbit",
           "int4-lowbit", "gguf-Q4_1", "gguf-Q8_0")
GGUF_KERNEL_FORMATS = ("Q4_1", "Q8_0")  # the embedded model's: Q4_1 layers, a Q8_0 embedding (its tied head)


@dataclass(frozen=True)
class KernelCell:
    shape: str  # e.g. "gate_up 576->3072"
    rows: int
    kernel: str
    microseconds: float | None  # None: the kernel does not run here


def add_quant_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct", help="short name, HF folder or .gguf file")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the model's dtype (and the lowbit kernels' activations)")
    parser.add_argument("--rows", type=int_list, default=[1, 4, 16, 64], help="kernel row counts (default 1,4,16,64)")
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 4, 16], help="engine concurrency (default 1,4,16)")
    parser.add_argument("--configs", type=lambda t: [c for c in t.split(",") if c], default=list(CONFIGS),
                        help=f"engine configurations (default {','.join(CONFIGS)})")
    parser.add_argument("--output-len", type=positive_int, default=64, help="engine: output tokens per request")
    parser.add_argument("--continuation-len", type=positive_int, default=32, help="quality: greedy tokens per prompt")
    parser.add_argument("--quality-prompts", type=positive_int, default=len(CALIBRATION_PROMPTS),
                        help=f"quality: prompts (the {len(CALIBRATION_PROMPTS)} calibration prompts, then the "
                        "edit prompts of bench spec)")
    parser.add_argument("--repeats", type=positive_int, default=30, help="kernel: timed calls per cell")
    parser.add_argument("--threads", type=positive_int, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--skip", type=lambda t: set(t.split(",")), default=set(),
                        help="parts to skip: kernels, quality, engine")


def model_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """name -> (in_features, out_features) of each distinct linear layer of a Llama-family model."""
    hidden = hf_config.hidden_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * head_dim, hf_config.num_key_value_heads * head_dim
    return {"qkv": (hidden, q + 2 * kv), "o": (q, hidden), "gate_up": (hidden, 2 * hf_config.intermediate_size),
            "down": (hf_config.intermediate_size, hidden), "lm_head": (hidden, hf_config.vocab_size)}


def _kernel_fns(in_features: int, out_features: int, dtype: torch.dtype):
    """kernel name -> (rows -> callable), or None where the kernel cannot run. The lowbit kernels
    take x in ``dtype``."""
    weight = torch.randn(out_features, in_features) * 0.02
    q = quantize_weight(weight)
    int8_layer = Int8Linear(weight, None, "int8")
    int4_layer = Int4Linear(weight, None) if in_features % 64 == 0 else None
    fns = {"float32": lambda x: F.linear(x, weight)}
    fns["float32-packed"] = PackedLinear(torch.nn.Linear(in_features, out_features, bias=False)) \
        if can_pack(torch.device("cpu"), torch.float32) else None
    pack_dtype = int8pack_dtype("cpu", torch.float32)
    scale = q.scale.to(pack_dtype) if pack_dtype else None
    fns["int8pack-bf16"] = (lambda x: torch.ops.aten._weight_int8pack_mm(x.to(pack_dtype), q.weight_int8, scale)
                            .float()) if pack_dtype else None
    fns["int8-widened"] = int8_layer.widened  # what Int8Linear runs above its int8pack row limit
    fns["int8-dynamic-fbgemm"] = Int8Linear(weight, None, "int8-dynamic") if fbgemm_available() else None
    has_lowbit = lowbit_gemm() is not None
    fns["int8-lowbit"] = (lambda x: int8_layer(x.to(dtype))) if has_lowbit and int8_layer.packed_int8 is not None else None
    fns["int4-lowbit"] = (lambda x: int4_layer(x.to(dtype))) if has_lowbit and int4_layer is not None else None
    for name in GGUF_KERNEL_FORMATS:
        fns[f"gguf-{name}"] = _gguf_layer(weight, name, dtype) if gguf_gemm() is not None else None
    return fns


def _gguf_layer(weight: torch.Tensor, name: str, dtype: torch.dtype):
    """The weight quantized by the gguf package into ``name`` blocks, as a layer fed ``dtype`` x."""
    fmt = block_format(name)
    raw = torch.from_numpy(gguf_quantize(weight.numpy(), GGMLQuantizationType[name]))
    layer = GGUFLinear(torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False), [BlockPart(raw, fmt)],
                       residual=True)
    return lambda x: layer(x.to(dtype))


def measure_kernels(hf_config, rows: list[int], repeats: int, dtype: torch.dtype = torch.float32, progress=None,
                    task=None) -> list[KernelCell]:
    cells = []
    for name, (fan_in, fan_out) in model_shapes(hf_config).items():
        fns = _kernel_fns(fan_in, fan_out, dtype)
        for n in rows:
            x = torch.randn(n, fan_in)
            for kernel in KERNELS:
                fn = fns[kernel]
                micros = None
                if (kernel.endswith("lowbit") or kernel.startswith("gguf")) and n > 16:  # widened past 16 rows
                    fn = None
                if fn is not None:
                    with torch.inference_mode():
                        for _ in range(3):
                            fn(x)
                        times = []
                        for _ in range(repeats):
                            start = time.perf_counter()
                            fn(x)
                            times.append(time.perf_counter() - start)
                    micros = statistics.median(times) * 1e6
                cells.append(KernelCell(f"{name} {fan_in}->{fan_out}", n, kernel, micros))
            if progress is not None:
                progress.advance(task)
    return cells


def decode_step_totals(cells: list[KernelCell], hf_config) -> list[dict]:
    """Per (rows, kernel): the linear time of one forward pass (every layer's four
    matmuls plus the LM head), in milliseconds."""
    counts = {"qkv": hf_config.num_hidden_layers, "o": hf_config.num_hidden_layers,
              "gate_up": hf_config.num_hidden_layers, "down": hf_config.num_hidden_layers, "lm_head": 1}
    totals: dict[tuple[int, str], float | None] = {}
    for cell in cells:
        key = (cell.rows, cell.kernel)
        part = None if cell.microseconds is None else cell.microseconds * counts[cell.shape.split()[0]] / 1e3
        if key not in totals:
            totals[key] = part
        elif totals[key] is not None:
            totals[key] = None if part is None else totals[key] + part
    return [{"rows": r, "kernel": k, "ms": v} for (r, k), v in totals.items()]


def measure_quality(model: str, configs: list[str], continuation_len: int, dtype: str = "float32",
                    num_prompts: int = len(CALIBRATION_PROMPTS)) -> dict[str, dict]:
    def llm(**overrides):
        return LLM(model, dtype=dtype, device="cpu", num_blocks=256, enable_prefix_caching=False, **overrides)

    reference = llm()
    tokenizer = reference.engine.worker.tokenizer
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                              add_generation_prompt=True), add_special_tokens=False)
               for p in CALIBRATION_PROMPTS[:num_prompts]]
    if num_prompts > len(prompts):
        prompts += build_prompt_ids(tokenizer, num_prompts - len(prompts))[0]
    engine = reference.engine
    greedy = SamplingParams(max_tokens=continuation_len, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, greedy) for p in prompts]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    sequences = [p + list(done[i]) for p, i in zip(prompts, ids)]
    text_ids = tokenizer.encode(PERPLEXITY_TEXT.read_text())
    ref = reference_of(engine.worker, sequences, [len(p) for p in prompts], text_ids)
    results = {}
    for name in configs:
        if name == "full":
            continue
        report = compare(ref, llm(**CONFIGS[name]).engine.worker, stepwise=name in STEPWISE)
        results[name] = {**asdict(report), "perplexity_change": report.perplexity_change}
        gc.collect()
    return results


def measure_engine(model: str, configs: list[str], batch_sizes: list[int], output_len: int,
                   dtype: str = "float32") -> list[dict]:
    rows = []
    prompt_ids = None
    for name in configs:
        llm = LLM(model, dtype=dtype, device="cpu", enable_prefix_caching=False,
                  max_num_seqs=max(batch_sizes), kv_cache_memory="512MiB", **CONFIGS[name])
        if prompt_ids is None:
            prompt_ids, _ = build_prompt_ids(llm.engine.worker.tokenizer, max(batch_sizes))
        for batch_size in batch_sizes:
            run_closed_loop(llm.engine, prompt_ids[:batch_size], 4, batch_size)  # warm-up
            timings, seconds = run_closed_loop(llm.engine, prompt_ids[:batch_size], output_len, batch_size)
            tokens = sum(t.output_tokens for t in timings)
            rows.append({"config": name, "batch_size": batch_size, "tok_per_s": tokens / seconds,
                         "kv_blocks_512mib": llm.engine.worker.runner.num_blocks})
        del llm
        gc.collect()
    base = {r["batch_size"]: r["tok_per_s"] for r in rows if r["config"] == "full"}
    for r in rows:
        r["vs_full"] = r["tok_per_s"] / base[r["batch_size"]] if r["batch_size"] in base else None
    return rows


def measure_quant(args: argparse.Namespace, console: Console) -> dict:
    """Kernels, quality and engine speed of each configuration (those not skipped); returns the JSON result."""
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown configurations {unknown}; known: {', '.join(CONFIGS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    source = resolve_model(args.model)
    hf_config = load_hf_config(source)
    result = {"model": args.model, "dtype": args.dtype, "rows": args.rows, "threads": torch.get_num_threads(),
              "load_average_start": os.getloadavg()}
    if "kernels" not in args.skip:
        with Progress(console=console) as progress:
            task = progress.add_task("quantized kernels", total=len(model_shapes(hf_config)) * len(args.rows))
            cells = measure_kernels(hf_config, args.rows, args.repeats, getattr(torch, args.dtype), progress, task)
        result["kernels"] = [asdict(c) for c in cells]
        result["decode_step_linear_ms"] = decode_step_totals(cells, hf_config)
    if "quality" not in args.skip:
        console.print(f"quality: teacher-forced comparison with {args.dtype} ...")
        result["quality"] = measure_quality(args.model, args.configs, args.continuation_len, args.dtype,
                                            args.quality_prompts)
    if "engine" not in args.skip:
        console.print("engine: closed-loop decoding ...")
        result["engine"] = measure_engine(args.model, args.configs, args.batch_sizes, args.output_len, args.dtype)
    result["load_average_end"] = os.getloadavg()
    return result


def print_quant(console: Console, result: dict) -> None:
    rows, dtype = result["rows"], result["dtype"]
    if "decode_step_linear_ms" in result:
        table = Table(title="linear layers of one forward pass (ms; sum of per-shape medians)")
        table.add_column("kernel")
        for n in rows:
            table.add_column(f"{n} rows", justify="right")
        for kernel in KERNELS:
            cells = {c["rows"]: c["ms"] for c in result["decode_step_linear_ms"] if c["kernel"] == kernel}
            table.add_row(kernel, *["-" if cells.get(n) is None else f"{cells[n]:.1f}" for n in rows])
        console.print(table)
    if "quality" in result:
        table = Table(title=f"quality against the unquantized model in {dtype} (teacher-forced)")
        for col in ("config", "top-1 agreement", "perplexity", f"{dtype} perplexity", "change",
                    "largest top-1 logprob move"):
            table.add_column(col, justify="right")
        for name, q in result["quality"].items():
            table.add_row(name, f"{q['top1_agreement']:.3f} of {q['num_agreement_tokens']}", f"{q['perplexity']:.3f}",
                          f"{q['reference_perplexity']:.3f}", f"{q['perplexity_change'] * 100:+.2f}%",
                          f"{q['max_top1_logprob_difference']:.3f}")
        console.print(table)
    if "engine" in result:
        table = Table(title="engine decoding (output tok/s, closed loop)")
        for col in ("config", "batch", "tok/s", "vs full", "KV blocks in 512 MiB"):
            table.add_column(col, justify="right")
        for r in result["engine"]:
            ratio = "-" if r["vs_full"] is None else f"{r['vs_full']:.2f}x"
            table.add_row(r["config"], str(r["batch_size"]), f"{r['tok_per_s']:.1f}", ratio, str(r["kv_blocks_512mib"]))
        console.print(table)


QUANT = Benchmark("quant", "int8 and 4-bit kernels, quality and tok/s against full precision",
                  add_quant_args, measure_quant, print_quant)
