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
from dataclasses import dataclass
from pathlib import Path

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
