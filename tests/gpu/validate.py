"""Validate Tandem's native engine on a GPU: correctness against transformers, and decode speed.

Run from the repository root on the machine that ``device`` lends (one GPU, torch and transformers,
no vLLM, no Ray, no registry), after ``tests/gpu/prepare.sh`` here has packed what it lacks::

    python3 tests/gpu/validate.py --stage-only                 # keep what this call carried (docs/gpu.md)
    python3 tests/gpu/validate.py --device cuda --out $OUT     # the checks and the throughput table
    python3 tests/gpu/validate.py --device cuda --only lora/,sync/   # some checks again, the rest skipped
    python tests/gpu/validate.py --device cpu --quick --out DIR   # the dry run, as make test runs it

Checks (``checks.py``): greedy parity with ``transformers.generate`` on tiny random Llama, Qwen2 and
OPT models and on the embedded SmolLM2-135M-Instruct when it was carried; speculative decoding's
greedy exactness with n-gram and draft-model proposers; the KV cache under preemption; LoRA; the
engine in its engine-core process, as ``tandem serve`` runs it. Then decode throughput of Tandem's
engine, in process and in its core process, against ``transformers.generate`` at batch 1, 8, 32 and
128 (``throughput.py``) on the embedded model, else on a random model of its shape. Whatever cannot
run (a package missing, the model not carried, no CUDA) is reported as skipped or error with the
reason, never a crash. Writes ``validate.json`` and ``validate.txt`` under ``--out``; exits 0 when
no check failed or errored, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(1, str(ROOT))  # after this folder (sys.path[0]): checks.py, carry.py, throughput.py

import carry  # noqa: E402  (carry, report and suite import only the standard library at the top)
import report  # noqa: E402
import suite  # noqa: E402

# import name -> distribution name, for the packages every check needs
REQUIRED = {"torch": "torch", "transformers": "transformers", "tokenizers": "tokenizers",
            "safetensors": "safetensors", "numpy": "numpy", "yaml": "pyyaml", "jinja2": "jinja2",
            "pydantic": "pydantic", "xxhash": "xxhash", "llguidance": "llguidance"}
OPTIONAL = {"gguf": "gguf", "peft": "peft"}  # converts the carried embedded model; makes the LoRA check's adapters


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--out", type=Path, help="folder for validate.json and validate.txt")
    parser.add_argument("--quick", action="store_true", help="tiny models only, batch 1 and 4, 8 tokens (dry run)")
    parser.add_argument("--stage-only", action="store_true", help="keep what this call carried, report, stop")
    parser.add_argument("--stash", type=Path, default=Path("/tmp/tandem-gpu"),
                        help="where carried parts and wheels are kept between calls (default /tmp/tandem-gpu)")
    parser.add_argument("--carry", type=Path, default=HERE / "carry",
                        help="where this call's carried folders are (default tests/gpu/carry)")
    parser.add_argument("--batch-sizes", help="comma list (default 1,8,32,128; --quick 1,4)")
    parser.add_argument("--output-len", type=int, help="tokens per request in the throughput runs (default 128)")
    parser.add_argument("--dtype", help="throughput dtype (default bfloat16 on CUDA, float32 on the CPU)")
    parser.add_argument("--repeats", type=int, help="timed runs per throughput cell, best kept (default 2)")
    parser.add_argument("--only", default="", help="comma list of check name prefixes to run (lora/,throughput); "
                        "the others are reported as skipped")
    args = parser.parse_args(argv)
    quick = args.quick
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else \
        ([1, 4] if quick else [1, 8, 32, 128])
    args.output_len = args.output_len or (8 if quick else 128)
    args.repeats = args.repeats or (1 if quick else 2)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    return args


def environment() -> dict:
    """Python, torch and the device; each needed package's version beside pyproject.toml's pin."""
    pins = dict(re.findall(r'"([A-Za-z0-9_.-]+)==([^"]+)"', (ROOT / "pyproject.toml").read_text()))
    packages, missing = {}, []
    for module, dist in {**REQUIRED, **OPTIONAL}.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(dist)
            continue
        try:
            installed = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            installed = "?"
        packages[dist] = {"version": installed, "pin": pins.get(dist)}
    env = {"python": platform.python_version(), "machine": platform.machine(), "packages": packages,
           "missing": missing, "missing_required": [d for d in missing if d in REQUIRED.values()]}
    if "torch" in packages:
        import torch

        env["torch_cuda"] = torch.version.cuda
        env["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return env


def stage_only(args, stage: carry.StageReport) -> int:
    parts = (f"parts here {stage.parts_present}, missing {stage.parts_missing}" if stage.manifest else
             "no model parts carried yet")
    ready = f"; {stage.model_file.name} reassembled and checked" if stage.model_file else ""
    wheels = f"; installed {', '.join(stage.installed)}" if stage.installed else "; no wheels installed"
    print(f"staged in {args.stash}: {parts}{ready}{wheels}")
    for problem in stage.problems:
        print(f"problem: {problem}")
    if args.out:
        report.write(args.out, {"stage": stage.to_dict()}, "\n".join(stage.problems))
    return 1 if stage.problems else 0


def run_all(args, stage: carry.StageReport, env: dict, run: suite.Run) -> tuple[dict | None, str | None]:
    """Every check in order; returns the throughput result and its table (None when not measured)."""
    if env["missing_required"]:
        run.skip_all(suite.ALL_CHECKS, "error", f"cannot run without {', '.join(env['missing_required'])} "
                                                "(tests/gpu/prepare.sh packs them; carry tests/gpu/carry/wheels)")
        return None, None
    if args.device.startswith("cuda") and not env.get("cuda_available"):
        run.skip_all(suite.ALL_CHECKS, "error", f"--device {args.device}, but torch sees no CUDA device")
        return None, None
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per model saved or loaded would bury the report
    with tempfile.TemporaryDirectory(prefix="tandem-gpu-") as work:
        work = Path(work)
        models = run.section(suite.TINY_CHECKS, lambda: suite.tiny_models(work)) or {}
        if models:
            run.section(suite.TINY_CHECKS, lambda: suite.run_tiny(run, args.device, models))
        try:
            embedded, why = suite.find_embedded(args.quick, stage)
        except Exception as err:  # a conversion that failed: say so, go on with the rest
            embedded, why = None, f"could not convert the carried model: {type(err).__name__}: {err}"
        if embedded is None:
            run.skip_all(suite.EMBEDDED_CHECKS, "error" if why.startswith("could not") else "skipped", why)
        else:
            run.section(suite.EMBEDDED_CHECKS, lambda: suite.run_embedded(run, args.device, embedded, stage))
        picked = run.section(["throughput"], lambda: suite.throughput_model(args.quick, models, embedded, work))
        result = suite.run_throughput(run, vars(args), *picked) if picked else None
    if result is None:
        return None, None
    import throughput

    return result, throughput.format_table(result)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stage = carry.stage(args.carry, args.stash)
    if stage.site is not None:
        sys.path.insert(0, str(stage.site))  # before the machine's own versions of the same packages
    # Interpreters started from here (the engine-core process) import the same packages and the project.
    os.environ["PYTHONPATH"] = os.pathsep.join([*([str(stage.site)] if stage.site else []), str(ROOT),
                                                *filter(None, [os.environ.get("PYTHONPATH")])])
    if args.stage_only:
        return stage_only(args, stage)
    env = environment()
    run = suite.Run(tuple(prefix for prefix in args.only.split(",") if prefix))
    result, table = run.section(suite.ALL_CHECKS, lambda: run_all(args, stage, env, run)) or (None, None)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "stash", "carry", "stage_only")}
    doc = report.document(settings, env, stage.to_dict(), run.results, result)
    text = report.text(doc, table)
    print("\n" + text)
    if args.out:
        report.write(args.out, doc, text)
    return 0 if doc["summary"]["failed"] == doc["summary"]["error"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
