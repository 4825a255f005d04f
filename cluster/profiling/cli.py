"""``tandem profile [CONFIG]``: measure step times and acceptance, write the k-per-batch-size profile
(a group with ``engine: vllm`` is profiled on vLLM)."""

from __future__ import annotations

import argparse
import json

from cluster.config import ConfigError, engine_config_from_args, group_engine_config, with_overrides
from cluster.engine.engine import Engine
from cluster.profiling.calibration import ACCEPTANCE_PROMPT_SETS
from cluster.profiling.profiler import power_of_two_sizes, run_profile, set_synthetic_acceptance
from cluster.profiling.vllm_profile import print_grid, run_vllm_profile


def cmd_profile(args: argparse.Namespace) -> int:
    config = engine_config_from_args(args)
    if args.group:
        # A group's profile is measured on its own device with its engine settings and split.
        config = group_engine_config(config, args.group)
        group_tp = config.serve.groups[0].tensor_parallel_size
        if group_tp > 1:
            config = with_overrides(config, tensor_parallel_size=group_tp)
    if config.speculative.method == "none":
        config = with_overrides(config, method="ngram")
    max_batch = args.max_batch or config.scheduler.max_num_seqs
    if config.engine.backend == "vllm":
        if args.synthetic_acceptance:
            raise ConfigError("--synthetic-acceptance sets Tandem's runner; the vLLM engine has no such switch")
        if args.acceptance_prompts != "calibration":
            raise ConfigError(f"--acceptance-prompts {args.acceptance_prompts}: the vLLM profile measures "
                              "acceptance on the calibration prompts only")

        profile, grid = run_vllm_profile(config, power_of_two_sizes(max_batch), args.max_k, args.output_len,
                                         args.repeats or 1)
        print_grid(profile, grid)
    else:
        # The profile is what the controllers will read: make one with the fixed policy.
        engine = Engine(with_overrides(config, controller="fixed", num_speculative_tokens=args.max_k))
        try:
            synthetic = set_synthetic_acceptance(engine, args.synthetic_acceptance)
            profile = run_profile(engine, power_of_two_sizes(max_batch), args.max_k, args.context_len,
                                  args.repeats or 3, args.acceptance_prompts)
            if synthetic is not None:  # the file says so wherever it is read
                profile.acceptance_prompts = synthetic.label()
        finally:
            engine.worker.close()  # tensor-parallel ranks, if any
    profile.save(args.out)
    print(f"device {profile.device}; draft {profile.draft}; acceptance ({profile.acceptance_prompts} prompts) "
          "per position "
          + ", ".join(f"{a:.2f}" for a in profile.acceptance))
    if profile.coverage is not None:
        print("coverage per position (share of positions asked for that got a draft token) "
              + ", ".join(f"{c:.2f}" for c in profile.coverage))
    print(f"fitted step-time model, mean relative error {profile.fit_error:.1%}")
    print("best k per batch size: " + ", ".join(f"{b}: {k}" for b, k in profile.table.items()))
    if args.vllm_schedule:
        print(json.dumps({"num_speculative_tokens_per_batch_size": profile.vllm_schedule()}))
    print(f"wrote {args.out}")
    return 0


def add_profile_parser(sub) -> None:
    prof = sub.add_parser("profile", help="measure step times and acceptance; write the k-per-batch-size profile")
    prof.add_argument("config", nargs="?", help="YAML settings file (e.g. configs/local.yaml)")
    prof.add_argument("--out", default="speculation-profile.json", help="where to write the profile JSON")
    prof.add_argument("--max-k", type=int, default=8, help="largest speculation length to measure")
    prof.add_argument("--max-batch", type=int, help="largest batch size (default: scheduler.max_num_seqs)")
    prof.add_argument("--context-len", type=int, default=128, help="context tokens per sequence while timing")
    prof.add_argument("--repeats", type=int, help="timed passes per cell (median is kept; default 3, vLLM 1)")
    prof.add_argument("--output-len", type=int, default=48,
                      help="engine: vllm only: tokens each request generates while its steps are timed")
    prof.add_argument("--acceptance-prompts", choices=ACCEPTANCE_PROMPT_SETS, default="calibration",
                      help="measure acceptance on the mixed calibration chat prompts or on `tandem bench spec`'s "
                           "edit requests (rewrite / summarize / proofread a passage in the prompt)")
    prof.add_argument("--synthetic-acceptance", metavar="ALPHA",
                      help="timing rigs only: accept each draft position with this probability (or per position: "
                           "0.9,0.8,0.7) instead of verifying it; the profile's acceptance_prompts says so")
    prof.add_argument("--group", help="profile this serve.groups entry (its engine settings), on its device kind")
    prof.add_argument("--vllm-schedule", action="store_true",
                      help="also print the table as vLLM's num_speculative_tokens_per_batch_size")
    prof.add_argument("--model", help="short name, Hugging Face folder or .gguf file")
    prof.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "auto"])
    prof.add_argument("--device", help="auto, cpu, cuda or cuda:N")
    prof.add_argument("--tensor-parallel-size", type=int, help="split the target over this many ranks")
    prof.set_defaults(func=cmd_profile)
