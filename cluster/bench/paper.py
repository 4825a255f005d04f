"""``tandem bench paper``: the results of arXiv 2310.18813 ("The Synergy of Speculative
Decoding and Batching") on our engine, in one run on one loaded model.

1. **TPOT vs k per batch size.** A speculation profile is made first (``run_profile``:
   step times over (batch size, k) and acceptance on the calibration prompts; it fits
   TPOT(b, k) = (k T_draft(b) + T_target(b, k + 1)) / E(k)). Then each (batch size b, k)
   cell submits b prompts at once and generates ``output_len`` greedy tokens each (EOS
   ignored) under ``FixedController(k)``, in rounds until every prompt of the set was
   served: prompt lookup's acceptance differs several-fold between prompts, so every batch
   size must see the same ones (when cells took the first 4, batch 1 rested on the prompts
   that copy most and its best k looked larger than it is). Measured TPOT is set against
   the model's prediction with the profile's acceptance (what the controllers use) and
   with the cell's own measured acceptance (which isolates the step-time part of the model).
   The sweep and its summary live in :mod:`paper_sweep`.
2. **Traffic.** Open-loop Poisson arrivals in real time (:mod:`paper_traffic`): uniform
   rates at ``RATE_FRACTIONS`` of a capacity measured in part 1 (requests/s of the
   largest batch at its best k), or ``--rates``; and a phased workload (the lightest
   rate, the heaviest, the lightest again). Every policy (fixed k, ``table``,
   ``adaptive``) serves the same arrival trace; adaptive starts afresh from the profile
   in every run. Goals are checked on mean TPOT against the best fixed k.

Prompts (``--prompts``): ``edit`` is :mod:`cluster.profiling.edit_prompts`'s rewrite / summarize / proofread /
continue requests (n-gram prompt lookup pays on them at every batch size here);
``calibration`` is the profiler's chat requests, most of them open-ended, where lookup
drafts less (the default profile's model has k fall from 8 to 0 at batch 8 on them);
``code`` (HumanEval completions) and ``agentic`` (tool-calling agent conversations) are
:mod:`cluster.bench.workloads`' sets, 16 prompts of each. ``--proportions`` times a
random-weight target and draft of chosen shapes (:mod:`cluster.bench.proportions`) on 16
random prompts instead, with ``--synthetic-acceptance``.
Prefix caching is off, so identical prompts are prefilled cold in every run. Figures:
:mod:`paper_plots`. Heavy imports stay inside functions: ``tandem`` builds this parser for
every command.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from dataclasses import asdict
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress

from cluster.bench.args import int_list, k_list, positive_int
from cluster.bench.benchmark import Benchmark
from cluster.bench.offline import DTYPES, concrete_dtype
from cluster.bench.paper_plots import write_plots
from cluster.bench.paper_report import print_tables
from cluster.bench.paper_sweep import (
    WARMUP_LEN, add_predictions, measured_capacity, sweep, sweep_summary, with_workload_acceptance,
)
from cluster.bench.paper_traffic import RunResult, Workload, phased_workload, run_open_loop, uniform_workload
from cluster.bench.proportions import PAIRS, Proportions, build_pair, get_pair, random_prompt_ids
from cluster.bench.spec import run_closed_loop
from cluster.bench.workloads.prompt_sets import DESCRIPTIONS, PAPER_NUM_PROMPTS, workload_prompt_ids
from cluster.engine.llm import LLM
from cluster.models.loader import load_tokenizer, resolve_model
from cluster.profiling.profiler import run_profile, set_synthetic_acceptance
from cluster.spec_decode.controller import AdaptiveController, FixedController, TableController

PROMPT_SETS = {name: DESCRIPTIONS[name] for name in ("edit", "calibration", "code", "agentic")}
RANDOM_PROMPTS = "random token ids of --prompt-len each (with --proportions: the models' weights are random too)"
RATE_FRACTIONS = (0.25, 0.55, 0.85)  # of the measured capacity: light, medium, near saturation
UNIFORM_GOAL = 0.02  # adaptive at most 2% behind the best fixed k at every uniform rate
PHASED_GOAL = 0.09  # adaptive at least 9% ahead of the best fixed k on phased traffic
HYSTERESIS = 0.05
TRAFFIC = ("all", "uniform", "phased", "none")


def _rate_list(text: str) -> list[float]:
    try:
        rates = [float(s) for s in text.split(",")]
    except ValueError:
        rates = []
    if not rates or not all(r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"expected request rates > 0 per second like 0.5,1,2, got {text!r}")
    return rates


def add_paper_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct", help="short name, HF folder or .gguf file")
    parser.add_argument("--method", choices=("ngram", "eagle3"), default="ngram", help="how drafts are proposed")
    parser.add_argument("--draft-model", help="the EAGLE-3 head (folder or shipped name) for --method eagle3")
    parser.add_argument("--dtype", choices=(*DTYPES, "auto"), default="auto",
                        help="auto: bfloat16 where the device computes it natively, else float32")
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 2, 4, 8, 16],
                        help="batch sizes of the TPOT-vs-k sweep and the profile (default 1,2,4,8,16)")
    parser.add_argument("--ks", type=k_list, default=list(range(7)),
                        help="fixed speculation lengths, swept and served as policies (default 0..6)")
    parser.add_argument("--max-k", type=positive_int, default=6, help="largest k of table and adaptive")
    parser.add_argument("--output-len", type=positive_int, default=48, help="output tokens per request (EOS ignored)")
    parser.add_argument("--requests", type=positive_int, default=32, help="requests per traffic run (default 32)")
    parser.add_argument("--repeats", type=positive_int, default=1,
                        help="traffic runs per policy and workload, in rotated order; the median run is reported")
    parser.add_argument("--rates", type=_rate_list,
                        help="uniform arrival rates in requests/s (default: fractions of a measured capacity); "
                             "the phased workload alternates the lowest and the highest")
    parser.add_argument("--traffic", choices=TRAFFIC, default="all",
                        help="which traffic runs follow the sweep: every uniform rate and the phased workload "
                             "(all), one kind, or none (the sweep and the step-time models only)")
    parser.add_argument("--max-num-seqs", type=positive_int,
                        help="the engine's batch limit (default: the largest of --batch-sizes)")
    parser.add_argument("--profile-acceptance", choices=("calibration", "workload"), default="calibration",
                        help="acceptance the table and adaptive policies start from: the profiler's calibration "
                             "prompts, or the sweep's measurement on this benchmark's prompts (the paper profiled "
                             "per dataset)")
    parser.add_argument("--prompts", choices=tuple(PROMPT_SETS), default="edit",
                        help="the requests of sweep and traffic: edit a given passage (lookup copies a lot), the "
                             "calibration chat requests (mostly open-ended), HumanEval code completions, or "
                             "tool-calling agent conversations (made once with SmolLM2 and cached)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrival traces")
    parser.add_argument("--synthetic-acceptance", metavar="ALPHA",
                        help="timing rigs: accept each draft position with this probability (or per position: "
                             "0.9,0.8,0.7) instead of verifying it; every table and the JSON say so")
    parser.add_argument("--threads", type=positive_int, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="Tandem's KV cache budget")
    parser.add_argument("--proportions", choices=tuple(PAIRS),
                        help="time a random-weight target and draft of chosen shapes instead of --model "
                             "(paper: OPT-6.7B with OPT-125M; cpu: a pair scaled for this CPU; tiny: smoke runs), "
                             "on random prompts; needs --synthetic-acceptance")
    parser.add_argument("--prompt-len", type=positive_int, default=128,
                        help="with --proportions: each random prompt's length in tokens (default 128)")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")


def measure_paper(args: argparse.Namespace, console: Console) -> dict:
    """Profile, sweep, serve the traffic; returns the JSON result."""
    if args.max_k > 16:
        raise ValueError(f"--max-k must be at most 16 (the engine's bound), got {args.max_k}")
    if args.threads:
        torch.set_num_threads(args.threads)
    started, load_average = time.perf_counter(), os.getloadavg()
    pair = _use_proportions(args, console) if args.proportions else None
    source = resolve_model(args.model)
    args.dtype = concrete_dtype(args.dtype, source)
    if pair is not None:
        prompt_ids = random_prompt_ids(pair.target.vocab_size, PAPER_NUM_PROMPTS, args.prompt_len, args.seed)
        prompt_format = "random"
    else:
        tokenizer = load_tokenizer(source)
        if tokenizer is None:
            raise ValueError(f"{args.model} has no tokenizer; this benchmark builds text prompts")
        prompt_ids, prompt_format = workload_prompt_ids(args.prompts, tokenizer, announce=console.print)
    top_k = max(args.max_k, max(args.ks))
    if args.method == "eagle3" and not args.draft_model:
        raise ValueError("--method eagle3 needs --draft-model (an EAGLE-3 head folder or a shipped head's name)")
    console.print(f"loading {Path(args.model).name} {args.dtype} with {args.method} speculation")
    llm = LLM(str(source.path), dtype=args.dtype, device=args.device, method=args.method,
              draft_model=args.draft_model, num_speculative_tokens=top_k,
              max_num_seqs=args.max_num_seqs or max(args.batch_sizes), enable_prefix_caching=False,
              kv_cache_memory=args.kv_cache_memory)
    engine = llm.engine
    synthetic = set_synthetic_acceptance(engine, args.synthetic_acceptance)
    if synthetic is not None:
        console.print(f"[bold]{synthetic.label()}[/]: drafts are accepted as drawn, not verified (timing only)")
    run_closed_loop(engine, prompt_ids[:max(args.batch_sizes)], WARMUP_LEN, max(args.batch_sizes))
    context_len = round(sum(map(len, prompt_ids)) / len(prompt_ids) + args.output_len / 2)
    profile = run_profile(engine, args.batch_sizes, top_k, context_len)

    policies = [f"k={k}" for k in args.ks] + ["table", "adaptive"]
    num_rates = len(args.rates) if args.rates else len(RATE_FRACTIONS)
    num_workloads = {"all": num_rates + 1, "uniform": num_rates, "phased": 1, "none": 0}[args.traffic]
    with Progress(console=console) as progress:
        task = progress.add_task("TPOT vs k", total=len(args.batch_sizes) * len(args.ks)
                                 + num_workloads * len(policies) * args.repeats)
        cells = sweep(engine, args, prompt_ids, progress, task)
        calibration_acceptance = profile.acceptance
        if args.profile_acceptance == "workload":
            profile = with_workload_acceptance(profile, cells)
        add_predictions(cells, profile)
        capacity = measured_capacity(cells, args)
        rates = args.rates or [float(f"{f * capacity['requests_per_s']:.3g}") for f in RATE_FRACTIONS]
        workloads = ([uniform_workload(r, args.requests, args.seed) for r in rates]
                     if args.traffic in ("all", "uniform") else [])
        if args.traffic in ("all", "phased"):
            workloads.append(phased_workload(min(rates), max(rates), args.requests, args.seed))
        traffic = [_serve(engine, w, policies, profile, prompt_ids, args, progress, task) for w in workloads]

    return {
        "machine": {"cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "torch_version": torch.__version__, "threads": torch.get_num_threads(),
                    "load_average_1_5_15m": list(load_average)},
        "settings": {"model": args.model, "model_path": str(source.path), "method": args.method,
                     "draft_model": args.draft_model, "dtype": args.dtype,
                     "batch_sizes": args.batch_sizes, "ks": args.ks, "max_k": args.max_k,
                     "max_num_seqs": engine.config.scheduler.max_num_seqs,
                     "output_len": args.output_len, "requests": args.requests, "repeats": args.repeats,
                     "traffic": args.traffic,
                     "seed": args.seed,
                     "prompt_format": prompt_format, "prompt_lens": [len(p) for p in prompt_ids],
                     "prompts": args.prompts, "workload": PROMPT_SETS.get(args.prompts, RANDOM_PROMPTS),
                     "prefix_caching": False,
                     "sampling": "greedy, ignore_eos",
                     "min_requests_per_cell": len(prompt_ids), "rate_fractions": list(RATE_FRACTIONS),
                     "profile_context_len": context_len, "adaptive_hysteresis": HYSTERESIS,
                     "profile_acceptance": args.profile_acceptance, "calibration_acceptance": calibration_acceptance,
                     "synthetic_acceptance": None if synthetic is None else synthetic.label(),
                     "proportions": None if pair is None else {**asdict(pair), "draft_model_path": args.draft_model},
                     "tpot": "per request (finish - first token) / (output tokens - 1), mean over requests"},
        "profile": profile.model_dump(),
        "tpot_vs_k": sweep_summary(cells, args, profile.table),
        "capacity": capacity,
        "traffic": {"policies": policies, "workloads": traffic},
        "goals": _goals(traffic),
        "wall_s": time.perf_counter() - started,
    }


def _use_proportions(args: argparse.Namespace, console: Console) -> Proportions:
    """Point ``args`` at the pair's folders (built once) and at random prompts."""
    pair = get_pair(args.proportions)
    if not args.synthetic_acceptance:
        raise ValueError("--proportions times random-weight models, whose drafts agree with nothing: give "
                         "--synthetic-acceptance ALPHA (e.g. 0.8, or per position 0.9,0.8,0.7)")
    console.print(f"proportions {pair.name}: {pair.why}")
    folders = build_pair(pair)
    args.model, args.method, args.draft_model, args.prompts = str(folders.target), "draft", str(folders.draft), "random"
    if args.dtype == "auto":
        args.dtype = pair.dtype
    return pair


# ---- part 2: traffic ------------------------------------------------------------------
def _controller(policy: str, profile, max_k: int):
    if policy == "table":
        return TableController({b: min(k, max_k) for b, k in profile.table.items()})
    if policy == "adaptive":
        return AdaptiveController.from_profile(profile, max_k, hysteresis=HYSTERESIS)
    return FixedController(int(policy.removeprefix("k=")))


def _serve(engine, workload: Workload, policies, profile, prompt_ids, args, progress, task) -> dict:
    """Every policy serves ``workload`` ``args.repeats`` times. Each round starts at another
    policy (rounds spread evenly over the list) and every other round runs the list
    backwards, so on a machine whose speed drifts no policy always runs first or last, nor
    always right after the same one; a policy's entry is its median run by mean TPOT (the
    lower median for an even count), with every run's mean TPOT beside it."""
    by_policy: dict[str, list[RunResult]] = {policy: [] for policy in policies}
    for round_ in range(args.repeats):
        shift = round_ * len(policies) // args.repeats
        order = policies if round_ % 2 == 0 else policies[::-1]
        for policy in order[shift:] + order[:shift]:
            progress.update(task, description=f"traffic {workload.name}: {policy} (round {round_ + 1})")
            engine.controller = _controller(policy, profile, args.max_k)
            by_policy[policy].append(run_open_loop(engine, workload, prompt_ids, args.output_len, policy))
            progress.advance(task)
    runs = [_median_run(by_policy[policy]) for policy in policies]
    fixed = [r for r in runs if r.policy.startswith("k=")]
    best = min(fixed, key=lambda r: r.mean_tpot_ms)
    gaps = {r.policy: r.mean_tpot_ms / best.mean_tpot_ms - 1 for r in runs if r.policy in ("table", "adaptive")}
    entries = []
    for r in runs:
        entry = asdict(r)
        if r.policy.startswith("k="):
            entry["steps"] = []  # only the controllers' choices are worth the space
        entry["gap_vs_best_fixed"] = r.mean_tpot_ms / best.mean_tpot_ms - 1
        entry["repeat_mean_tpot_ms"] = [run.mean_tpot_ms for run in by_policy[r.policy]]
        entries.append(entry)
    return workload.to_json() | {"runs": entries, "gaps": gaps,
                                 "best_fixed": {"policy": best.policy, "mean_tpot_ms": best.mean_tpot_ms},
                                 "phase_oracle": _phase_oracle(workload, fixed, best),
                                 "run_to_run": _run_to_run([by_policy[r.policy] for r in fixed])}


def _run_to_run(runs_per_policy: list[list[RunResult]]) -> float | None:
    """How far repeated runs of one fixed k fall apart: per fixed-k policy, its slowest
    run's mean TPOT over its fastest's, minus 1; the median over the policies. A gap
    between policies smaller than this is within the noise of the machine. None with
    one run per policy."""
    spreads = sorted(max(r.mean_tpot_ms for r in runs) / min(r.mean_tpot_ms for r in runs) - 1
                     for runs in runs_per_policy if len(runs) > 1)
    return spreads[(len(spreads) - 1) // 2] if spreads else None


def _phase_oracle(workload: Workload, fixed: list[RunResult], best: RunResult) -> dict | None:
    """The headroom any controller has on a phased workload: the best fixed k of each phase
    chosen in hindsight (per phase, the fixed-k run whose requests of that phase had the
    lowest mean TPOT), as a request-weighted mean TPOT against the best single fixed k's,
    both from the same runs. Noise in the per-phase minima only flatters the oracle, so a
    gap smaller than a goal says the goal is out of reach on this workload. None for a
    single phase."""
    if len(workload.phases) < 2 or any(len(r.phase_mean_tpot_ms) != len(workload.phases) for r in fixed):
        return None
    picks = [min(fixed, key=lambda r: r.phase_mean_tpot_ms[p]) for p in range(len(workload.phases))]
    weights = [phase.num_requests for phase in workload.phases]
    oracle = sum(w * r.phase_mean_tpot_ms[p] for p, (w, r) in enumerate(zip(weights, picks))) / sum(weights)
    single = sum(w * t for w, t in zip(weights, best.phase_mean_tpot_ms)) / sum(weights)
    return {"policies": [r.policy for r in picks], "mean_tpot_ms": oracle, "best_fixed_mean_tpot_ms": single,
            "gap_vs_best_fixed": oracle / single - 1}


def _median_run(runs: list[RunResult]) -> RunResult:
    return sorted(runs, key=lambda r: r.mean_tpot_ms)[(len(runs) - 1) // 2]


def _goals(traffic: list[dict]) -> list[dict]:
    """gap = policy TPOT / best fixed TPOT - 1: positive is behind, negative ahead. A goal
    met or missed by a margin no larger than the run-to-run spread is marked
    ``within_noise``: these runs cannot tell the one from the other."""
    uniform = [w for w in traffic if w["kind"] == "uniform"]
    phased = [w for w in traffic if w["kind"] == "phased"]
    worst = max(uniform, key=lambda w: w["gaps"]["adaptive"]) if uniform else None
    goals = []
    if worst is not None:
        goals.append({"goal": f"adaptive at most {UNIFORM_GOAL:.0%} behind the best fixed k at every uniform rate",
                      "workload": worst["name"], "adaptive_gap": worst["gaps"]["adaptive"],
                      "table_gap": worst["gaps"]["table"], "run_to_run": worst.get("run_to_run"),
                      "met": worst["gaps"]["adaptive"] <= UNIFORM_GOAL,
                      "within_noise": _within_noise(worst["gaps"]["adaptive"] - UNIFORM_GOAL, worst)})
    for w in phased:
        oracle = w.get("phase_oracle")
        goals.append({"goal": f"adaptive at least {PHASED_GOAL:.0%} ahead of the best fixed k on phased traffic",
                      "workload": w["name"], "adaptive_gap": w["gaps"]["adaptive"], "table_gap": w["gaps"]["table"],
                      "phase_oracle_gap": oracle["gap_vs_best_fixed"] if oracle else None,
                      "run_to_run": w.get("run_to_run"),
                      "met": w["gaps"]["adaptive"] <= -PHASED_GOAL,
                      "within_noise": _within_noise(w["gaps"]["adaptive"] + PHASED_GOAL, w)})
    return goals


def _within_noise(margin: float, workload: dict) -> bool:
    """A goal missed (``margin`` > 0) or met (< 0) by no more than the workload's run-to-run spread."""
    spread = workload.get("run_to_run")
    return spread is not None and abs(margin) <= spread


PAPER = Benchmark("paper", "arXiv 2310.18813 here: TPOT vs k per batch, k policies under traffic",
                  add_paper_args, measure_paper, print_tables, plots=write_plots)
