"""Where the engine-core hand-off's time goes: the same decode batch in process and through the core.

Run from the repository root where ``validate.py`` runs (its wheels staged first; py-spy's wheel
among them for the sampled profiles)::

    python3 tests/gpu/handoff_profile.py --device cuda --out $OUT
    python tests/gpu/handoff_profile.py --device cpu --shape tiny --batch-sizes 16,64   # on the CPU

For each batch size, greedy, EOS ignored, ``--output-len`` tokens a request, after one untimed
warm-up run of each: (1) the engine in process (``Engine.step`` in a loop, as ``tandem bench
offline`` runs it), each step's wall time beside ``Engine.step``'s and the forward pass's; (2) the
same engine in its engine-core process (``ProcessClient``, what ``tandem serve``'s replica runs),
every token streamed back, with the core's own step timeline (``step_timeline.py``: idle, taking
messages, stepping, of that the forward pass, sending) over the timed run. With ``py-spy`` on the
path, both processes are sampled during the timed core run, and each one's busiest functions (own
time) and threads are printed. Prints tables, writes ``handoff_profile.json`` and py-spy's raw
stacks under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(1, str(HERE.parents[1]))

import carry  # noqa: E402
from suite import throughput_model  # noqa: E402  (a random model of SmolLM2's shape)


def tiny_model(work: Path) -> Path:
    """Two layers of width 128 with SmolLM2's vocabulary: a step short enough for the hand-off to show on a CPU."""
    from cluster.models.tiny import save_tiny_model, save_tiny_tokenizer, tiny_llama_config

    config = tiny_llama_config(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=32, intermediate_size=256, vocab_size=49152, max_position_embeddings=2048)
    path = save_tiny_model(config, work / "tiny")
    save_tiny_tokenizer(path)
    return path


def prompts(batch_size: int) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(batch_size)
    return [torch.randint(100, 5000, (32,), generator=generator).tolist() for _ in range(batch_size)]


def in_process(llm, batch: list[list[int]], output_len: int) -> dict:
    """Mean ms a loop iteration, of it ``Engine.step``, of that the forward pass and sampling."""
    from cluster.shared.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    result = {}
    for _ in range(2):  # a warm-up, then the timed run (the figures kept are the last run's)
        for ids in batch:
            engine.add_request(ids, params)
        steps, step_s, execute_s, produced = 0, 0.0, 0.0, 0
        started = time.perf_counter()
        while engine.has_unfinished():
            produced += sum(len(out.outputs[0].delta_token_ids) for out in engine.step())
            record = engine.last_step
            steps, step_s, execute_s = steps + 1, step_s + record.seconds, execute_s + record.execute_seconds
        wall = time.perf_counter() - started
        result = {"tok_per_s": produced / wall, "steps": steps, "loop_ms": 1e3 * wall / steps,
                  "engine_step_ms": 1e3 * step_s / steps, "forward_ms": 1e3 * execute_s / steps}
    return result


class Sampler:
    """py-spy recording one process, raw folded stacks: non-blocking (it never pauses the process), or
    with native frames (paused at every sample, so the timings of that run are not the process's own)."""

    def __init__(self, pid: int, out: Path, rate: int, native: bool = False) -> None:
        self.out, self.rate, self.started = out, rate, time.monotonic()
        mode = ["--native"] if native else ["--nonblocking"]  # native frames need the process paused
        self.process = subprocess.Popen(
            ["py-spy", "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw", "--threads", *mode,
             "--output", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> float:
        seconds = time.monotonic() - self.started
        self.process.send_signal(2)  # py-spy writes its output on SIGINT
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        return seconds


def summarize_stacks(path: Path, seconds: float, rate: int, top: int = 14) -> dict:
    """Each thread's share of one core (samples over rate x seconds) and the busiest functions by own time."""
    threads, leaves, total = collections.Counter(), collections.Counter(), 0
    if not path.exists():
        return {"error": f"py-spy wrote no {path.name}"}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        threads[frames[0]] += int(count)
        leaves[(frames[-1].split(" (")[0][:100] + " " + _file_of(frames[-1]))] += int(count)
        total += int(count)
    possible = max(rate * seconds, 1.0)
    return {"samples": total, "seconds": seconds,
            "threads": {name: round(n / possible, 3) for name, n in threads.most_common(8)},
            "top_own": [(name, round(n / possible, 3)) for name, n in leaves.most_common(top)]}


def _file_of(frame: str) -> str:
    inside = frame.partition(" (")[2].rstrip(")")
    return "(" + "/".join(inside.split("/")[-2:]) + ")" if inside else ""


def through_core(runner, batch: list[list[int]], output_len: int, out: Path | None, rate: int,
                 native: bool = False) -> dict:
    """Tokens per second through the core, its timeline over the timed run, and py-spy's view."""
    runner.generate(batch, output_len)  # warm-up
    samplers = {}
    if out is not None and rate > 0 and shutil.which("py-spy"):
        samplers = {name: Sampler(pid, out / f"pyspy-{name}-b{len(batch)}.txt", rate, native)
                    for name, pid in (("replica", os.getpid()), ("core", runner.backend.core_pid))}
        time.sleep(0.5)  # py-spy attached
    started = time.perf_counter()
    produced = runner.generate(batch, output_len)
    wall = time.perf_counter() - started
    profiles = {name: summarize_stacks(s.out, s.stop(), rate) for name, s in samplers.items()}
    since_start = time.perf_counter() - started  # the timed run's steps, not the warm-up's
    timeline = asyncio.run(runner.backend.step_timeline(since_start))["summary"]
    return {"tok_per_s": produced / wall, "timeline": timeline, "profiles": profiles}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--shape", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--batch-sizes", default="32,128")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples a second (0: no py-spy)")
    parser.add_argument("--native", action="store_true", help="py-spy with native frames (pauses the processes)")
    parser.add_argument("--core-first", action="store_true", help="measure through the core before in process")
    parser.add_argument("--stash", type=Path, default=Path("/tmp/tandem-gpu"))
    parser.add_argument("--carry", type=Path, default=HERE / "carry")
    args = parser.parse_args(argv)
    stage = carry.stage(args.carry, args.stash)
    if stage.site is not None:
        sys.path.insert(0, str(stage.site))
        paths = [str(stage.site), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")]
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)  # the core's too
        os.environ["PATH"] = os.pathsep.join([str(stage.site / "bin"), os.environ.get("PATH", "")])
    import torch

    from cluster.engine.llm import LLM
    from throughput import CoreRunner

    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    cuda = args.device.startswith("cuda")
    dtype = "bfloat16" if cuda else "float32"
    kv = "4GiB" if cuda else "512MiB"
    rows = []
    with tempfile.TemporaryDirectory(prefix="tandem-handoff-") as work:
        path = throughput_model(False, {}, None, Path(work))[1] if args.shape == "smollm2" else tiny_model(Path(work))

        def measure_in_process() -> dict:
            llm = LLM(str(path), dtype=dtype, device=args.device, max_num_seqs=max(batch_sizes), kv_cache_memory=kv)
            try:
                return {b: in_process(llm, prompts(b), args.output_len) for b in batch_sizes}
            finally:
                llm.engine.worker.close()
                del llm
                if cuda:
                    torch.cuda.empty_cache()

        def measure_core() -> dict:
            runner = CoreRunner(str(path), dtype, max(batch_sizes), kv, args.device)
            try:
                return {b: through_core(runner, prompts(b), args.output_len, args.out, args.rate, args.native)
                        for b in batch_sizes}
            finally:
                runner.close()

        if args.core_first:
            core = measure_core()
            inproc = measure_in_process()
        else:
            inproc = measure_in_process()
            core = measure_core()
        rows = [{"batch_size": b, "in_process": inproc[b], "core": core[b]} for b in batch_sizes]
    order = "the core first" if args.core_first else "in process first"
    sampling = f"at {args.rate} Hz{' with native frames' if args.native else ''}" if args.rate else "off"
    lines = [f"decode through the engine core, {args.shape} {dtype} on {args.device}, {args.output_len} tokens a "
             f"request, {order}, py-spy {sampling}",
             f"{'batch':>6} {'in-proc tok/s':>14} {'loop ms':>8} {'step ms':>8} {'fwd ms':>7} | {'core tok/s':>11} "
             f"{'core/in':>8} {'step ms':>8} {'fwd ms':>7} {'py ms':>6} {'handoff ms':>11} {'idle':>6} {'busy':>6}"]
    for row in rows:
        i, c = row["in_process"], row["core"]
        t = c["timeline"]
        lines.append(f"{row['batch_size']:>6} {i['tok_per_s']:>14.1f} {i['loop_ms']:>8.2f} {i['engine_step_ms']:>8.2f} "
                     f"{i['forward_ms']:>7.2f} | {c['tok_per_s']:>11.1f} {c['tok_per_s'] / i['tok_per_s']:>8.2f} "
                     f"{t.get('mean_step_ms', 0):>8.2f} {t.get('mean_forward_and_sampling_ms', 0):>7.2f} "
                     f"{t.get('mean_python_around_forward_ms', 0):>6.2f} {t.get('mean_handoff_ms', 0):>11.2f} "
                     f"{t.get('idle_fraction', 0):>6.2f} {t.get('busy_fraction', 0):>6.2f}")
    for row in rows:
        for name, profile in row["core"]["profiles"].items():
            lines.append(f"\npy-spy, {name} process, batch {row['batch_size']} ({profile.get('samples', 0)} samples): "
                         f"share of a core by thread {profile.get('threads', profile.get('error'))}")
            lines.extend(f"  {share:6.3f}  {fn}" for fn, share in profile.get("top_own", []))
    table = "\n".join(lines)
    print(table)
    if args.out:
        (args.out / "handoff_profile.json").write_text(json.dumps({"rows": rows, "table": table}, indent=1))
        (args.out / "handoff_profile.txt").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
