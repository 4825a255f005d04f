"""``tandem bench prefix``: what prefix caching buys, cache on next to cache off in one run.

Two engines on the same weights live side by side, one with prefix caching and one
without (an engine without it is always cold, so cold runs need no reloading).

* TTFT: a shared system prompt of exactly ``system_tokens`` tokens (seeded English
  text cut with the model's tokenizer) and a short distinct question per request,
  ``max_tokens=1``, one request at a time. TTFT runs from ``add_request`` (so it
  includes tokenizing) to the step that returns the first token. *Cold* is the
  cache-off engine; *warm* is the cache-on engine after a first request with the same
  system prompt has finished. Reported: medians and cold/warm.
* Multi-turn chat: ``conversations`` x ``turns``; each turn's prompt renders the whole
  history (system prompt, earlier questions, the model's own answers as text) plus the
  new question; turn t of every conversation is one ``generate`` batch; greedy,
  ``output_len`` tokens, EOS ignored. Reported: time, output tok/s, the engine's
  ``num_computed_tokens`` and prefix cache hit rate, on/off ratios, and whether the
  outputs match token for token (greedy: they must).

Prompts use the model's chat template (system + user messages); a tokenizer without
one gets plain ``Role: text`` concatenation. Every engine first serves one untimed
request of the same length with an unrelated system prompt, so no timing includes
first-call warm-up and no measured prompt shares a block with it.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich import box
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from cluster.bench.args import positive_int, timed
from cluster.bench.benchmark import Benchmark
from cluster.bench.offline import DTYPES, PROMPTS, concrete_dtype
from cluster.engine.llm import LLM
from cluster.models.loader import resolve_model
from cluster.shared.sampling_params import SamplingParams

TTFT_SEED, CHAT_SEED, WARMUP_SEED = 0, 1, 2
GOAL_COLD_OVER_WARM = 5.0
WORDS = (
    "the a river mountain city engineer quietly builds bridges over ancient stone while children watch from "
    "windows every morning light falls across wooden rooftops and old markets where merchants sell bread cheese "
    "apples spices copper lamps silk maps clocks under painted signs travelers arrive carrying letters stories "
    "about distant harbors storms ships lighthouses forests wolves owls gardens libraries scholars argue about "
    "numbers stars seasons music poems history machines rivers flow slowly toward the sea and winter brings snow "
    "silence patience careful measurement good tools honest work small victories long evenings warm soup friends "
    "remember how their grandparents planted orchards repaired fences counted sheep sang songs wrote journals"
).split()


@dataclass(frozen=True)
class TTFTSample:
    """One request timed to its first token."""

    kind: str  # "cold" (cache off), "cold_first" (first on the cache-on engine) or "warm"
    prefix_caching: bool
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float


@dataclass(frozen=True)
class ChatRun:
    """The whole multi-turn workload on one engine; counters are this run's deltas."""

    prefix_caching: bool
    seconds: float
    prompt_tokens: int
    output_tokens: int
    tok_per_s: float
    num_computed_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float


def add_prefix_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct", help="short name, HF folder or .gguf file")
    parser.add_argument("--dtype", choices=(*DTYPES, "auto"), default="auto",
                        help="auto: bfloat16 where the device computes it natively, else float32")
    parser.add_argument("--system-tokens", type=positive_int, default=1024, help="shared system prompt (TTFT)")
    parser.add_argument("--warm-requests", type=positive_int, default=5, help="timed cold and warm requests each")
    parser.add_argument("--conversations", type=positive_int, default=8)
    parser.add_argument("--turns", type=positive_int, default=4)
    parser.add_argument("--chat-system-tokens", type=positive_int, default=256, help="system prompt of the chats")
    parser.add_argument("--output-len", type=positive_int, default=32, help="tokens per chat turn (EOS ignored)")
    parser.add_argument("--threads", type=positive_int, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="KV cache budget of each engine")


def make_system_prompt(tokenizer, num_tokens: int, seed: int) -> str:
    """Seeded English-like text that encodes to exactly ``num_tokens`` tokens."""
    rng = random.Random(seed)
    sentences: list[str] = []
    ids: list[int] = []
    while len(ids) < num_tokens + 16:
        for _ in range(max(8, num_tokens // 10)):
            words = rng.choices(WORDS, k=rng.randint(6, 16))
            sentences.append(" ".join(words).capitalize() + rng.choice(".....;!?"))
        ids = tokenizer.encode(" ".join(sentences), add_special_tokens=False)
    cut = num_tokens
    for _ in range(8):  # decode/encode can merge or split at the cut: nudge it until exact
        text = tokenizer.decode(ids[:cut])
        got = len(tokenizer.encode(text, add_special_tokens=False))
        if got == num_tokens:
            return text
        cut += num_tokens - got
    raise RuntimeError(f"could not cut the system prompt to exactly {num_tokens} tokens")


def render(tokenizer, system: str, history: list[tuple[str, str]], question: str) -> str:
    """The prompt for ``question`` after ``history`` ((question, answer) pairs)."""
    messages = [{"role": "system", "content": system}]
    for asked, answered in history:
        messages += [{"role": "user", "content": asked}, {"role": "assistant", "content": answered}]
    messages.append({"role": "user", "content": question})
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages) + "Assistant:"


def question(i: int) -> str:
    """Distinct for every ``i``."""
    text = PROMPTS[i % len(PROMPTS)]
    return text if i < len(PROMPTS) else f"{text} (take {i // len(PROMPTS) + 1})"


def time_to_first_token(engine, prompt: str | list[int], kind: str) -> TTFTSample:
    """Run ``prompt`` (text or token ids) alone on an idle engine for one token."""
    if engine.has_unfinished():
        raise RuntimeError("TTFT needs an idle engine")
    start = time.perf_counter()
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    sample = None
    while engine.has_unfinished():
        for out in engine.step():
            if sample is None and out.request_id == request_id and out.outputs[0].token_ids:
                sample = TTFTSample(kind, engine.config.cache.enable_prefix_caching, out.usage.prompt_tokens,
                                    out.usage.cached_tokens, time.perf_counter() - start)
    return sample


def run_chat(llm, system: str, num_conversations: int, num_turns: int, output_len: int):
    """Returns the ChatRun and every turn's output token ids, ``[conversation][turn]``."""
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    histories: list[list[tuple[str, str]]] = [[] for _ in range(num_conversations)]
    output_ids: list[list[list[int]]] = [[] for _ in range(num_conversations)]
    before = llm.engine.stats()
    seconds = 0.0
    prompt_tokens = output_tokens = 0
    for turn in range(num_turns):
        questions = [question(c * num_turns + turn) for c in range(num_conversations)]
        prompts = [render(llm.tokenizer, system, h, q) for h, q in zip(histories, questions)]
        outs, took = timed(llm.generate, prompts, params)
        seconds += took
        for c, out in enumerate(outs):
            histories[c].append((questions[c], out.outputs[0].text))
            output_ids[c].append(list(out.outputs[0].token_ids))
            prompt_tokens += out.usage.prompt_tokens
            output_tokens += out.usage.completion_tokens
    after = llm.engine.stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    run = ChatRun(llm.engine.config.cache.enable_prefix_caching, seconds, prompt_tokens, output_tokens,
                  output_tokens / seconds, after.num_computed_tokens - before.num_computed_tokens,
                  queries, hits, hits / queries if queries else 0.0)
    return run, output_ids


def measure_prefix(args: argparse.Namespace, console: Console) -> dict:
    """Measure TTFT and multi-turn chat with the prefix cache on and off; returns the JSON result."""
    if args.threads:
        torch.set_num_threads(args.threads)
    load_average = os.getloadavg()
    source = resolve_model(args.model)
    args.dtype = concrete_dtype(args.dtype, source)
    n = args.warm_requests
    with Progress(console=console) as progress:
        task = progress.add_task("loading", total=4 + 2 * n + 1 + 2 * args.turns)
        llms = {}
        for caching in (True, False):
            progress.update(task, description=f"loading, prefix caching {'on' if caching else 'off'}")
            llms[caching] = LLM(str(source.path), dtype=args.dtype, device="cpu", enable_prefix_caching=caching,
                                kv_cache_memory=args.kv_cache_memory)
            progress.advance(task)
        tokenizer = llms[True].tokenizer
        if tokenizer is None:
            raise ValueError(f"{args.model} has no tokenizer; this benchmark builds text prompts")
        system = make_system_prompt(tokenizer, args.system_tokens, TTFT_SEED)
        warmup = render(tokenizer, make_system_prompt(tokenizer, args.system_tokens, WARMUP_SEED), [], question(0))
        for caching, llm in llms.items():
            progress.update(task, description="warm-up")
            llm.generate([warmup], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))  # prefill + decode
            progress.advance(task)

        # Cold and warm ask the same questions; the cache-on engine first sees question 0.
        plan = ([(False, i, "cold") for i in range(1, n + 1)] + [(True, 0, "cold_first")]
                + [(True, i, "warm") for i in range(1, n + 1)])
        samples: list[TTFTSample] = []
        for caching, i, kind in plan:
            progress.update(task, description=f"TTFT, {kind}, prefix caching {'on' if caching else 'off'}")
            prompt = render(tokenizer, system, [], question(i))
            samples.append(time_to_first_token(llms[caching].engine, prompt, kind))
            progress.advance(task)

        chat_system = make_system_prompt(tokenizer, args.chat_system_tokens, CHAT_SEED)
        runs, outputs = {}, {}
        for caching, llm in llms.items():
            progress.update(task, description=f"multi-turn chat, prefix caching {'on' if caching else 'off'}")
            runs[caching], outputs[caching] = run_chat(llm, chat_system, args.conversations, args.turns,
                                                       args.output_len)
            progress.advance(task, args.turns)

    return _result(args, source, load_average, samples, runs, outputs, llms[True].engine)


def _result(args, source, load_average, samples, runs, outputs, engine) -> dict:
    def median(kind: str) -> float:
        return statistics.median(s.ttft_s for s in samples if s.kind == kind)

    cold, warm = median("cold"), median("warm")
    on, off = runs[True], runs[False]
    mismatched = [{"conversation": c, "turn": t, "first_diff_token": _first_diff(outputs[True][c][t],
                                                                                 outputs[False][c][t])}
                  for c in range(args.conversations) for t in range(args.turns)
                  if outputs[True][c][t] != outputs[False][c][t]]
    return {
        "machine": {"cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "torch_version": torch.__version__, "threads": torch.get_num_threads(),
                    "load_average_1_5_15m": list(load_average)},
        "settings": {"model": args.model, "model_path": str(source.path), "dtype": args.dtype,
                     "system_tokens": args.system_tokens, "warm_requests": args.warm_requests,
                     "conversations": args.conversations, "turns": args.turns,
                     "chat_system_tokens": args.chat_system_tokens, "output_len": args.output_len,
                     "kv_cache_memory": args.kv_cache_memory, "block_size": engine.block_manager.block_size,
                     "prompt_format": "chat_template" if getattr(engine.tokenizer, "chat_template", None)
                     else "plain"},
        "ttft": {"samples": [asdict(s) for s in samples], "cold_median_s": cold, "warm_median_s": warm,
                 "cold_first_on_s": median("cold_first"), "cold_over_warm": cold / warm,
                 "goal_cold_over_warm": GOAL_COLD_OVER_WARM, "meets_goal": cold / warm >= GOAL_COLD_OVER_WARM},
        "multi_turn": {"runs": [asdict(on), asdict(off)],
                       "on_over_off_tok_per_s": on.tok_per_s / off.tok_per_s,
                       "on_over_off_computed_tokens": on.num_computed_tokens / off.num_computed_tokens,
                       "outputs_identical": not mismatched, "num_mismatched_turns": len(mismatched),
                       "mismatched_turns": mismatched},
    }


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def print_prefix(console: Console, result: dict) -> None:
    settings, ttft, chat = result["settings"], result["ttft"], result["multi_turn"]
    model = Path(settings["model"]).name
    table = Table(title=f"time to first token, {model} {settings['dtype']}, "
                        f"{settings['system_tokens']}-token shared system prompt",
                  caption=f"cold/warm = {ttft['cold_over_warm']:.1f}x (goal >= {ttft['goal_cold_over_warm']:.0f}x); "
                          f"first = the cache-on engine's first request; prompts: {settings['prompt_format']}",
                  box=box.SIMPLE_HEAD, show_edge=False)
    for header in ("requests", "prefix cache", "n", "prompt tokens", "cached tokens", "median ms", "min ms", "max ms"):
        table.add_column(header, justify="left" if header in ("requests", "prefix cache") else "right")
    for kind, label in (("cold", "cold"), ("cold_first", "first"), ("warm", "warm")):
        rows = [s for s in ttft["samples"] if s["kind"] == kind]
        times = [s["ttft_s"] * 1e3 for s in rows]
        table.add_row(label, "on" if rows[0]["prefix_caching"] else "off", str(len(rows)),
                      f"{statistics.median(s['prompt_tokens'] for s in rows):.0f}",
                      f"{statistics.median(s['cached_tokens'] for s in rows):.0f}",
                      f"{statistics.median(times):.1f}", f"{min(times):.1f}", f"{max(times):.1f}")
    console.print(table)

    table = Table(title=f"multi-turn chat, {settings['conversations']} conversations x {settings['turns']} turns, "
                        f"{settings['output_len']} tokens per turn",
                  caption=f"outputs identical on/off: {'yes' if chat['outputs_identical'] else 'NO'}; "
                          f"{settings['chat_system_tokens']}-token system prompt",
                  box=box.SIMPLE_HEAD, show_edge=False)
    for header in ("prefix cache", "seconds", "output tok/s", "prompt tokens", "computed tokens", "cache hit rate"):
        table.add_column(header, justify="left" if header == "prefix cache" else "right")
    for run in chat["runs"]:
        table.add_row("on" if run["prefix_caching"] else "off", f"{run['seconds']:.2f}", f"{run['tok_per_s']:.1f}",
                      str(run["prompt_tokens"]), str(run["num_computed_tokens"]),
                      f"{run['prefix_cache_hit_rate']:.0%}")
    on, off = chat["runs"]
    table.add_row("on/off", f"{on['seconds'] / off['seconds']:.2f}", f"{chat['on_over_off_tok_per_s']:.2f}", "",
                  f"{chat['on_over_off_computed_tokens']:.2f}", "")
    console.print(table)
    if not chat["outputs_identical"]:
        turns = settings["conversations"] * settings["turns"]
        console.print(f"[bold red]warning:[/] greedy outputs differ with the prefix cache on and off in "
                      f"{chat['num_mismatched_turns']} of {turns} turns. In float32 that is a bug; in 16-bit "
                      "dtypes near-tied logits can also flip: rerun with --dtype float32")


PREFIX = Benchmark("prefix", "TTFT and multi-turn chat throughput, prefix cache on vs off",
                   add_prefix_args, measure_prefix, print_prefix)
