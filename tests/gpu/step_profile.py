"""Where a decode step's time goes on a device: host wall time per step beside the device's kernel time.

Run from the repository root where ``validate.py`` runs (its wheels staged first)::

    python3 tests/gpu/step_profile.py --device cuda --out $OUT
    python tests/gpu/step_profile.py --device cpu --batch-sizes 1,4 --steps 8   # the dry run

A random model of SmolLM2-135M's shape (speed does not depend on the weights' values), bfloat16 on
CUDA, greedy, EOS ignored. For each batch size, after the prefill and a warm-up: the mean wall time
of ``Engine.step`` over ``--steps`` decode steps; on CUDA, the kernel time of the same steps from
``torch.profiler`` (the sum of every device kernel's own time, over the steps); and, at the largest
batch, cProfile's top functions by own time. ``--lora N`` serves N random rank-16 adapters and
times each batch three ways: base requests only, every request with one adapter, and the N
adapters round robin. On CUDA every workload runs with CUDA graphs (steps with adapter tokens
replay each bucket's LoRA graph) and then without (``enforce_eager``; not with ``--graphs-only``).
Prints a table, writes ``step_profile.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import itertools
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(1, str(HERE.parents[1]))

import carry  # noqa: E402
from suite import throughput_model  # noqa: E402  (a random model of SmolLM2's shape)


def decode_steps(engine, batch_size: int, warmup: int, steps: int, profiler=None, lora=None) -> float:
    """Mean wall ms of ``steps`` decode steps of a batch, each request long enough to outlast them;
    ``profiler`` (a context manager) is entered around those steps alone, not the prefill,
    warm-up or drain. ``lora``: each request's adapter name (None: the base model's)."""
    import torch

    from cluster.shared.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=warmup + steps + 4, temperature=0, ignore_eos=True)
    generator = torch.Generator().manual_seed(batch_size)
    for index in range(batch_size):
        prompt = torch.randint(100, 5000, (16,), generator=generator).tolist()
        engine.add_prepared(engine.make_request(prompt, params, lora=lora[index] if lora else None))
    while engine.scheduler.num_waiting:  # prefill every request
        engine.step()
    for _ in range(warmup):
        engine.step()
    with profiler or contextlib.nullcontext():
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        mean_ms = (time.perf_counter() - start) / steps * 1e3
    while engine.has_unfinished():
        engine.step()
    return mean_ms


def lora_adapters(model_path: Path, count: int, work: Path) -> dict[str, str]:
    """``count`` random rank-16 adapters on every projection of the model, as PEFT saves them."""
    from cluster.bench.lora import write_random_adapter
    from cluster.models.hf_folder import ModelSource
    from cluster.models.loader import load_hf_config

    hf_config = load_hf_config(ModelSource("profiled", model_path))
    return {f"adapter-{i}": str(write_random_adapter(work / f"adapter-{i}", hf_config, 16, i)) for i in range(count)}


def workloads(names: list[str]):
    """(name, batch size -> each request's adapter or None) for each timed workload."""
    if not names:
        return [("base", lambda b: None)]
    return [("base", lambda b: None), ("one", lambda b: [names[0]] * b),
            ("mixed", lambda b: [names[i % len(names)] for i in range(b)])]


@contextlib.contextmanager
def _profiling(profile: cProfile.Profile):
    profile.enable()
    try:
        yield
    finally:
        profile.disable()


def kernel_ms(prof, steps: int) -> float:
    """Device kernel time per step: every event's own device time, summed."""
    total_us = sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages())
    return total_us / 1e3 / steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--batch-sizes", default="1,8,32,128")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--stash", type=Path, default=Path("/tmp/tandem-gpu"),
                        help="where carried wheels are installed (as validate.py's --stash)")
    parser.add_argument("--carry", type=Path, default=HERE / "carry", help="this call's carried folders")
    parser.add_argument("--lora", type=int, default=0, help="serve this many random rank-16 adapters (see above)")
    parser.add_argument("--graphs-only", action="store_true", help="on CUDA, skip the enforce_eager runs")
    args = parser.parse_args(argv)
    stage = carry.stage(args.carry, args.stash)
    if stage.site is not None:
        sys.path.insert(0, str(stage.site))
    import torch

    from cluster.engine.llm import LLM

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    cuda = args.device.startswith("cuda")
    dtype = "bfloat16" if cuda else "float32"
    rows, top = [], ""
    with tempfile.TemporaryDirectory(prefix="tandem-profile-") as work:
        _, path, _ = throughput_model(False, {}, None, Path(work))
        adapters = lora_adapters(path, args.lora, Path(work)) if args.lora else {}
        names = list(adapters)
        for eager in ((False, True) if cuda and not args.graphs_only else (False,)):
            llm = LLM(str(path), dtype=dtype, device=args.device, max_num_seqs=max(batch_sizes),
                      kv_cache_memory="4GiB" if cuda else "256MiB", enforce_eager=eager,
                      **(dict(lora_modules=adapters, max_lora_rank=16) if adapters else {}))
            engine = llm.engine
            for batch_size, (workload, lora) in itertools.product(batch_sizes, workloads(names)):
                lora = lora(batch_size)
                wall = decode_steps(engine, batch_size, args.warmup, args.steps, lora=lora)
                row = {"batch_size": batch_size, "workload": workload, "cuda_graphs": cuda and not eager,
                       "wall_ms": round(wall, 3)}
                if cuda:
                    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                    prof = torch.profiler.profile(activities=activities)
                    # the timed steps only
                    decode_steps(engine, batch_size, args.warmup, args.steps, profiler=prof, lora=lora)
                    row["kernel_ms"] = round(kernel_ms(prof, args.steps), 3)
                if batch_size == max(batch_sizes) and not eager and workload == "base":
                    profile = cProfile.Profile()
                    decode_steps(engine, batch_size, args.warmup, args.steps, profiler=_profiling(profile))
                    text = io.StringIO()
                    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(18)
                    top = text.getvalue()
                rows.append(row)
                print(json.dumps(row), flush=True)
            llm.engine.worker.close()
            del llm, engine
            if cuda:
                torch.cuda.empty_cache()
    lines = [f"decode step, smollm2-135m-shaped (random) {dtype} on {args.device}, mean of {args.steps} steps",
             f"{'batch':>6} {'workload':>9} {'graphs':>7} {'wall ms':>9} {'kernel ms':>10} {'host share':>11}"]
    for row in rows:
        kernel = row.get("kernel_ms")
        share = f"{1 - kernel / row['wall_ms']:.0%}" if kernel else "-"
        lines.append(f"{row['batch_size']:>6} {row['workload']:>9} {str(row['cuda_graphs']):>7} {row['wall_ms']:>9.2f} "
                     f"{kernel if kernel is not None else '-':>10} {share:>11}")
    table = "\n".join(lines)
    print(top)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "step_profile.json").write_text(json.dumps({"rows": rows, "cprofile_top": top}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
