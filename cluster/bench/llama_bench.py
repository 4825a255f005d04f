"""llama.cpp's ``llama-bench`` as the offline peer of Tandem's GGUF blocks at batch 1.

``tandem bench offline --llamacpp`` runs it on the very GGUF file Tandem converts (the
``llamacpp_cpu.sh`` anchor's ``gguf`` answer), with the threads Tandem has, decoding
``output_len`` tokens after an empty prompt (``-p 0 -n N``), ``repeats`` times; its own warm-up
run comes first. llama-bench decodes one sequence, so its figure stands beside Tandem's batch-1
cells only.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich import box
from rich.table import Table

TIMEOUT_S = 900.0


@dataclass(frozen=True)
class LlamaBenchResult:
    tok_per_s: float  # llama-bench's mean over its repetitions
    stddev_tok_per_s: float
    model_bytes: int  # the file's tensors, as llama-bench reads them per token
    model_type: str  # e.g. "llama 256M Q4_1"
    threads: int
    build: str


def default_llama_bench() -> Path | None:
    """The binary the llama.cpp anchor built (``llamacpp_cpu.sh setup``), if there is one."""
    root = Path(os.environ.get("TANDEM_ANCHORS", Path.home() / ".cache" / "tandem-anchors"))
    found = sorted(root.glob("llama-cpp-python-*/vendor/llama.cpp/build/bin/llama-bench"))
    return found[-1] if found else None


def anchor_gguf(script: Path) -> Path:
    """The GGUF file the anchor serves (its ``gguf`` command)."""
    done = subprocess.run([str(script), "gguf"], capture_output=True, text=True, timeout=60)
    path = Path(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else None
    if done.returncode != 0 or path is None or not path.is_file():
        raise RuntimeError(f"{script} gguf gave no file (exit {done.returncode}): {done.stderr.strip()[-500:]}")
    return path


def parse_llama_bench(text: str) -> LlamaBenchResult:
    """The one decode test of llama-bench's ``-o json`` output."""
    records = [r for r in json.loads(text) if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0]
    if len(records) != 1:
        raise ValueError(f"expected one decode test in llama-bench's output, found {len(records)}")
    r = records[0]
    return LlamaBenchResult(float(r["avg_ts"]), float(r.get("stddev_ts", 0.0)), int(r["model_size"]),
                            str(r.get("model_type", "")), int(r["n_threads"]), str(r.get("build_commit", "")))


def run_llama_bench(binary: Path, gguf: Path, threads: int, output_len: int, repeats: int) -> LlamaBenchResult:
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(output_len),
           "-r", str(repeats), "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench exited with {done.returncode}: {done.stderr.strip()[-800:]}")
    return parse_llama_bench(done.stdout)


def llama_bench_inputs(binary: Path | None, script: Path) -> tuple[Path, Path]:
    """The llama-bench binary (``binary``, else the anchor's build) and the anchor's GGUF file;
    raises RuntimeError, before anything is measured, where there is none."""
    binary = binary or default_llama_bench()
    if binary is None or not Path(binary).is_file():
        raise RuntimeError("no llama-bench: run `llamacpp_cpu.sh setup` (the llama.cpp anchor) or pass --llama-bench")
    return Path(binary), anchor_gguf(script)


def llamacpp_beside(binary: Path, gguf: Path, output_len: int, repeats: int, ours: dict[str, float],
                    bandwidth_gb_s: float) -> dict:
    """llama-bench's batch-1 decoding with torch's threads, set beside Tandem's batch-1 tok/s on the
    same file (``ours``, per dtype) and the file's bound (read bandwidth over its bytes)."""
    peer = run_llama_bench(binary, gguf, torch.get_num_threads(), output_len, repeats)
    return {**asdict(peer), "gguf": str(gguf), "bound_tok_per_s": bandwidth_gb_s * 1e9 / peer.model_bytes,
            "tandem_gguf_batch1": ours, "tandem_gguf_over_llamacpp": {d: r / peer.tok_per_s for d, r in ours.items()}}


def print_llamacpp_table(console, peer: dict) -> None:
    bound = peer["bound_tok_per_s"]
    table = Table(title=f"batch 1 on the GGUF file's blocks ({peer['model_type']}), tok/s",
                  caption=f"llama-bench {peer['build']}, {peer['threads']} threads, mean of its repetitions "
                          f"(stddev {peer['stddev_tok_per_s']:.1f}); bound: read bandwidth / "
                          f"{peer['model_bytes'] / 1e6:.1f} MB a token",
                  box=box.SIMPLE_HEAD, show_edge=False)
    for header in ("Tandem dtype", "Tandem gguf", "llama.cpp", "Tandem/llama.cpp", "bound", "Tandem/bound",
                   "llama.cpp/bound"):
        table.add_column(header, justify="left" if header == "Tandem dtype" else "right")
    for dtype, ours in peer["tandem_gguf_batch1"].items():
        table.add_row(dtype, f"{ours:.1f}", f"{peer['tok_per_s']:.1f}", f"{ours / peer['tok_per_s']:.2f}",
                      f"{bound:.0f}", f"{ours / bound:.0%}", f"{peer['tok_per_s'] / bound:.0%}")
    console.print(table)
