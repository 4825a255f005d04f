"""``tandem bench spec``: what speculative decoding buys per batch size and ``k``.

The target is loaded once (with its n-gram proposer or draft model) and ``k`` is switched
between cells by swapping in a ``FixedController(k)``; ``k = 0`` is plain decoding on the
same engine. Every (batch size, k) cell serves the same prompts (``--prompts``, default ``edit``:
:mod:`cluster.profiling.edit_prompts`'s rewrite / summarize / proofread / continue a passage given
in the prompt, where prompt lookup is natural; ``code``: HumanEval completions; ``agentic``:
tool-calling agent conversations, :mod:`cluster.bench.workloads.prompt_sets`)
closed-loop at concurrency = batch size: a finished request is replaced
at once by the next prompt. Greedy, ``output_len`` tokens, EOS ignored, prefix caching off
(so every cell prefills the same prompts cold). Each cell first runs an untimed warm-up of
``batch size`` requests x ``WARMUP_LEN`` tokens at its own ``k``. ``--repeats N`` measures
every k of a batch size N times in rounds, each round starting at another k (so on a
machine whose speed drifts no k is always measured first), and pools a cell's rounds.
Suffix trees are emptied after each warm-up; ``--warm-tree N`` then seeds them with the target's
answers to N further prompts of the set (made once, greedy at k = 0), as a replica that has
served such prompts holds them.

Per cell (:mod:`cluster.bench.spec_cells`): output tok/s (all output tokens / wall time,
prefill included), TPOT per request as vLLM defines it ((last token time - first token time)
/ (output tokens - 1)), averaged over requests; TTFT; the engine's speculative counters over the timed run (acceptance rate
= accepted / drafted tokens, mean acceptance length = 1 + accepted / drafting steps); and
output tokens per target step (steps without a draft count too). Speedup is tok/s over
``k = 0`` at the same batch size. (vLLM's speculation is measured served, beside Tandem's
server: ``tandem bench served --vllm-speculative-config``.) ``--batch-invariant both`` measures each cell
twice, with ``model.batch_invariant`` off and on (one engine each, one after the other), and
reports what the mode costs and whether greedy output then equals plain decoding's.
``--temperature T`` samples instead (each request seeded with its prompt's index), and
``--verification both`` then measures every cell with coupled verification and with rejection
sampling (one engine each): acceptance, speed, and how many requests keep k = 0's text.
``--adaptive PROFILE`` adds a cell per batch size run by the adaptive controller started from
that ``tandem profile`` (k up to the largest of ``--ks``, fresh at each batch size and round),
printed as k = ``adaptive``, with its speed-up over k = 0 like any other.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress

from cluster.bench.args import int_list, k_list, positive_int, ratio_or_none
from cluster.bench.benchmark import Benchmark
from cluster.bench.offline import DTYPES, concrete_dtype
from cluster.bench.spec_cells import (ADAPTIVE_K, WARMUP_LEN, RequestTiming, SpecCell, SpecCounts, k_name,
                                      pool_rounds)
from cluster.bench.spec_report import TANDEM_INVARIANT, TANDEM_REJECTION, build_result, print_tables
from cluster.bench.workloads.prompt_sets import DESCRIPTIONS, workload_prompt_ids
from cluster.engine.llm import LLM
from cluster.models.loader import load_tokenizer, resolve_model
from cluster.shared.sampling_params import SamplingParams
from cluster.spec_decode.controller import AdaptiveController, FixedController
from cluster.spec_decode.profile_data import SpeculationProfile

SPEC_PROMPT_SETS = ("edit", "code", "agentic")


def add_spec_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct", help="short name, HF folder or .gguf file")
    parser.add_argument("--method", choices=("ngram", "suffix", "draft", "eagle3"), default="ngram",
                        help="how drafts are proposed")
    parser.add_argument("--draft-model", help="draft model for --method draft (the target itself = self-draft); "
                        "the EAGLE-3 head (folder or shipped name) for --method eagle3")
    parser.add_argument("--ngram-draft-per-match-token", type=ratio_or_none, default=1.0,
                        help="n-gram: a match shorter than 4 tokens drafts at most this many tokens per matched "
                             "token (default 1; none: every match drafts k, as vLLM)")
    parser.add_argument("--dtype", choices=(*DTYPES, "auto"), default="auto",
                        help="auto: bfloat16 where the device computes it natively, else float32")
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 4, 16], help="concurrency (default 1,4,16)")
    parser.add_argument("--ks", type=k_list, default=list(range(9)), help="speculation lengths (default 0..8)")
    parser.add_argument("--output-len", type=positive_int, default=128, help="output tokens per request (EOS ignored)")
    parser.add_argument("--num-prompts", type=positive_int, default=16, help="requests per cell (default 16)")
    parser.add_argument("--warm-tree", type=int, default=0, metavar="N",
                        help="suffix: every cell's trees start with the target's answers to N other prompts of the "
                             "set (as on a replica that has served them), instead of empty")
    parser.add_argument("--prompts", choices=SPEC_PROMPT_SETS, default="edit",
                        help="edit: rewrite / summarize / proofread a passage in the prompt; code: complete a "
                             "HumanEval function; agentic: tool-calling agent conversations up to the assistant's "
                             "next turn (made once with SmolLM2 and cached)")
    parser.add_argument("--quantization", choices=("none", "int8", "int4", "int8-dynamic"), default="none",
                        help="the target's weights")
    parser.add_argument("--draft-quantization", choices=("none", "int8", "int4", "int8-dynamic"),
                        help="the draft's weights (default: the target's); int4 or int8 + --draft-model TARGET = self-draft")
    parser.add_argument("--threads", type=positive_int, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="Tandem's KV cache budget")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default="auto")
    parser.add_argument("--repeats", type=positive_int, default=1,
                        help="rounds over every k per batch size, each starting at another k; a cell pools its rounds")
    parser.add_argument("--batch-invariant", choices=("off", "on", "both"), default="off",
                        help="model.batch_invariant for Tandem's engine; both: measure each cell with it off and on")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy; above: random sampling, each request seeded with its prompt's index")
    parser.add_argument("--verification", choices=("auto", "rejection", "coupled", "both"), default="auto",
                        help="speculative.verification; both: measure each cell coupled and by rejection sampling")
    parser.add_argument("--adaptive", type=Path, metavar="PROFILE",
                        help="also measure the adaptive controller started from this `tandem profile` JSON")


def run_closed_loop(engine, prompt_ids: list[list[int]], output_len: int, concurrency: int,
                    token_ids_out: dict[int, list[int]] | None = None,
                    steps_out: list | None = None, temperature: float = 0.0) -> tuple[list[RequestTiming], float]:
    """Serve every prompt with at most ``concurrency`` in flight; returns timings and wall seconds.
    With ``token_ids_out``, fills it with each prompt's (by index) output token ids; with
    ``steps_out``, appends each step's ``engine.last_step`` (:class:`~cluster.engine.engine.StepRecord`).
    Greedy, or with ``temperature`` > 0 random sampling seeded with the prompt's index."""
    if engine.has_unfinished():
        raise RuntimeError("the benchmark needs an idle engine")
    params = [SamplingParams(max_tokens=output_len, temperature=temperature, ignore_eos=True,
                             seed=i if temperature > 0 else None) for i in range(len(prompt_ids))]
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    steps: dict[str, int] = {}
    timings: list[RequestTiming] = []
    index: dict[str, int] = {}
    next_prompt = in_flight = 0
    start = time.perf_counter()
    while next_prompt < len(prompt_ids) or in_flight:
        while next_prompt < len(prompt_ids) and in_flight < concurrency:
            rid = engine.add_request(prompt_ids[next_prompt], params[next_prompt])
            added[rid], index[rid] = time.perf_counter(), next_prompt
            next_prompt += 1
            in_flight += 1
        outputs = engine.step()
        now = time.perf_counter()
        if steps_out is not None:
            steps_out.append(engine.last_step)
        for out in outputs:
            rid = out.request_id
            if out.outputs[0].delta_token_ids:
                if rid in first:
                    steps[rid] += 1
                else:
                    first[rid], steps[rid] = now, 0
            if out.finished:
                in_flight -= 1
                timings.append(RequestTiming(first[rid] - added[rid], now - first[rid],
                                             len(out.outputs[0].token_ids), steps[rid]))
                if token_ids_out is not None:
                    token_ids_out[index[rid]] = list(out.outputs[0].token_ids)
    return timings, time.perf_counter() - start


def engine_variants(args) -> list[tuple[str, dict]]:
    """(system name, engine settings) of each engine to measure, in order."""
    if args.verification == "both":
        if args.batch_invariant == "both":
            raise ValueError("--verification both and --batch-invariant both: choose one comparison per run")
        if args.temperature <= 0:
            raise ValueError("--verification both needs --temperature > 0: greedy drafts are verified alike")
        invariant = args.batch_invariant == "on"
        return [("tandem", dict(batch_invariant=invariant, verification="coupled")),
                (TANDEM_REJECTION, dict(batch_invariant=invariant, verification="rejection"))]
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.batch_invariant]
    return [(TANDEM_INVARIANT if invariant else "tandem", dict(batch_invariant=invariant,
                                                               verification=args.verification))
            for invariant in modes]


def _measure_tandem(args, source, prompt_ids, progress, task, system: str, variant: dict,
                    warm_ids: list[list[int]] = ()) -> list[SpecCell]:
    if args.method == "draft" and not args.draft_model:
        raise ValueError("--method draft needs --draft-model (a model sharing the target's tokenizer)")
    if args.method == "eagle3" and not args.draft_model:
        raise ValueError("--method eagle3 needs --draft-model (an EAGLE-3 head folder or a shipped head's name)")
    progress.update(task, description=f"loading {Path(args.model).name} {args.dtype}, {args.method} drafts")
    settings = dict(quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    if args.draft_quantization:
        settings["draft_quantization"] = args.draft_quantization
    if args.method == "ngram":
        settings["ngram_draft_per_match_token"] = args.ngram_draft_per_match_token
    llm = LLM(str(source.path), dtype=args.dtype, device="cpu", method=args.method, draft_model=args.draft_model,
              num_speculative_tokens=max(args.ks), enable_prefix_caching=False,
              max_num_seqs=max(args.batch_sizes), kv_cache_memory=args.kv_cache_memory, **variant, **settings)
    engine = llm.engine
    warm_answers: list[list[int]] = []
    if warm_ids:  # the answers a long-lived replica would have given to the set's other prompts
        progress.update(task, description=f"{system}: answering {len(warm_ids)} prompts for the trees")
        engine.controller = _controller(args, 0)
        answers: dict[int, list[int]] = {}
        run_closed_loop(engine, warm_ids, args.output_len, max(args.batch_sizes), answers,
                        temperature=args.temperature)
        warm_answers = [answers[i] for i in range(len(warm_ids))]
    cells = []
    ks = sorted(args.ks) + ([ADAPTIVE_K] if args.adaptive else [])
    for batch_size in args.batch_sizes:
        rounds: dict[int, list[tuple]] = {k: [] for k in ks}  # per k, each round's (timings, seconds, counts, outputs)
        for round_ in range(args.repeats):
            shift = round_ * len(ks) // args.repeats  # each round starts at another k
            for k in ks[shift:] + ks[:shift]:
                progress.update(task, description=f"{system} batch {batch_size}, k={k_name(k)}"
                                + (f" (round {round_ + 1})" if args.repeats > 1 else ""))
                engine.controller = _controller(args, k)
                run_closed_loop(engine, prompt_ids[:batch_size], min(WARMUP_LEN, args.output_len), batch_size,
                                temperature=args.temperature)
                if hasattr(engine.proposer, "clear"):  # suffix trees: every cell starts cold, as the first
                    engine.proposer.clear()  # (the warm-up served these prompts' first tokens)
                    engine.seed_suffix(warm_answers)
                before = SpecCounts.of(engine.stats().spec)
                outputs: dict[int, list[int]] = {}
                timings, seconds = run_closed_loop(engine, prompt_ids, args.output_len, batch_size, outputs,
                                                   temperature=args.temperature)
                rounds[k].append((timings, seconds, SpecCounts.of(engine.stats().spec).minus(before), outputs))
                tree = getattr(engine.proposer, "tree_stats", None)
                if tree is not None and tree.num_proposals:  # what the suffix trees cost in this run
                    args.suffix_cost.append({"batch_size": batch_size, "k": k_name(k),
                                             "us_per_proposal": 1e6 * tree.propose_seconds / tree.num_proposals,
                                             "us_per_token": 1e6 * tree.propose_seconds / max(tree.num_tokens_added, 1),
                                             "share_of_wall": tree.propose_seconds / seconds})
                progress.advance(task)
        for k in ks:
            runs = rounds[k]
            cell = pool_rounds(system, args.method, batch_size, k, args.output_len, [r[:3] for r in runs])
            if 0 in rounds:  # every round's outputs against k = 0's in the same round, as many as num_requests
                same = sum(run[3][i] == plain[3][i] for run, plain in zip(runs, rounds[0]) for i in plain[3])
                cell = dataclasses.replace(cell, identical_to_k0=same)
            cells.append(cell)
    del llm, engine
    gc.collect()
    return cells


def _controller(args, k: int):
    if k != ADAPTIVE_K:
        return FixedController(k)
    profile = SpeculationProfile.load(str(args.adaptive))
    return AdaptiveController.from_profile(profile, min(max(args.ks), profile.max_k))


def measure_spec(args: argparse.Namespace, console: Console) -> dict:
    """Measure every cell; returns the JSON result."""
    variants = engine_variants(args)
    args.suffix_cost = []  # per timed run with suffix drafts: the trees' cost
    if args.warm_tree and args.method != "suffix":
        raise ValueError("--warm-tree seeds the suffix trees: it needs --method suffix")
    if args.warm_tree < 0:
        raise ValueError(f"--warm-tree must be 0 or more, not {args.warm_tree}")
    if args.adaptive:
        SpeculationProfile.load(str(args.adaptive))  # a missing or broken profile fails before any model loads
    if args.threads:
        torch.set_num_threads(args.threads)
    load_average = os.getloadavg()
    source = resolve_model(args.model)
    args.dtype = concrete_dtype(args.dtype, source)
    tokenizer = load_tokenizer(source)
    if tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer; this benchmark builds text prompts")
    prompt_ids, prompt_format = workload_prompt_ids(args.prompts, tokenizer, args.num_prompts + args.warm_tree,
                                                    console.print)
    prompt_ids, warm_ids = prompt_ids[:args.num_prompts], prompt_ids[args.num_prompts:]
    if any(w in prompt_ids for w in warm_ids):
        raise ValueError(f"--warm-tree {args.warm_tree}: the {args.prompts} set has too few prompts for "
                         f"{args.num_prompts} measured and {args.warm_tree} others")
    with Progress(console=console) as progress:
        cells_per_batch = len(args.ks) + (1 if args.adaptive else 0)
        task = progress.add_task("loading",
                                 total=len(variants) * cells_per_batch * len(args.batch_sizes) * args.repeats)
        cells = [c for system, variant in variants
                 for c in _measure_tandem(args, source, prompt_ids, progress, task, system, variant, warm_ids)]

    load_average = {"start": list(load_average), "end": list(os.getloadavg())}
    if args.suffix_cost:
        console.print("suffix trees' cost (proposals, bringing the trees up to date included): "
                      + "; ".join(f"batch {c['batch_size']} k={c['k']}: {c['us_per_proposal']:.0f} us a step, "
                                  f"{c['us_per_token']:.1f} us a token, {100 * c['share_of_wall']:.2f}% of the run"
                                  for c in args.suffix_cost))
    result = build_result(args, source, load_average, prompt_ids, prompt_format, cells,
                          DESCRIPTIONS[args.prompts], WARMUP_LEN)
    result["settings"]["prompts"] = args.prompts
    if args.suffix_cost:
        result["suffix_cost"] = args.suffix_cost
    return result


SPEC = Benchmark("spec", "tok/s and TPOT per batch size and k, with acceptance",
                 add_spec_args, measure_spec, print_tables)
