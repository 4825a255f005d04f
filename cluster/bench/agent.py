"""``tandem bench agent``: speculation against plain decoding in an agent's conversations, token for token.

Each engine (plain decoding first, then each speculation method) plays the ``agentic``
workload's conversations as an agent loop does (:func:`~cluster.bench.workloads.agentic_prompts.build_conversations`):
a system prompt, four tools with JSON schemas, a bug-fix task, then assistant turns whose
``tool_choice`` cycles through :data:`CHOICES` (the plan's function named, ``required``,
``auto``), each call's result (file contents, search hits, pytest's report) fed back as a
``tool`` message. Every engine runs its own loop on its own outputs, as an agent would, so
a difference would carry on into the next turns. Greedy; ``model.batch_invariant`` by default,
so a token can differ from plain decoding's only through a fault, not through rounding between
row counts.

Per engine the table gives the turns, the forced calls that parse, the dead ends
(``grammar_dead_end``: a grammar left with no token), and the turns whose tokens equal plain
decoding's (a conversation counts up to its first different turn).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass

import torch
from rich.console import Console
from rich.table import Table

from cluster.api.tool_calls import parse_tool_calls
from cluster.api.tool_formats import choose_tool_format, render_chat
from cluster.api.tool_request import NamedToolChoice, ToolSpec, plan_tools
from cluster.bench.args import positive_int
from cluster.bench.benchmark import Benchmark
from cluster.bench.workloads.agentic_prompts import GenerateFn, build_conversations, offered_tools
from cluster.bench.workloads.agentic_tools import TOOLS
from cluster.bench.workloads.code_prompts import human_eval_problems
from cluster.config import TandemConfig, load_config, with_overrides
from cluster.engine.llm import LLM
from cluster.shared.sampling_params import SamplingParams

CHOICES = ("named", "required", "auto")  # the tool_choice of turn t is CHOICES[t % 3]
DEAD_END = "grammar_dead_end"


@dataclass
class TurnRecord:
    conversation: int
    turn: int
    choice: str
    finish_reason: str
    token_ids: list[int]
    parsed: bool  # the output holds a call the chat endpoint would return in tool_calls


def agent_generator(llm: LLM, tool_format: str, max_tokens: int, batch_size: int,
                    records: list[TurnRecord]) -> GenerateFn:
    """A generator for ``build_conversations`` that asks each turn as the chat endpoint would
    (tools rendered into the prompt; ``tool_choice`` per :data:`CHOICES`), ``batch_size``
    conversations at a time, and appends a :class:`TurnRecord` per conversation to ``records``."""
    specs = [ToolSpec.model_validate(t) for t in TOOLS]

    def params(choice: str, name: str) -> SamplingParams:
        tool_choice = (NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})
                       if choice == "named" else choice)
        plan = plan_tools(specs, tool_choice, False, tool_format)
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=plan.constraint)

    def generate(conversations: list[list[dict]], tool_names: list[str]) -> list[str]:
        turn = sum(m["role"] == "assistant" for m in conversations[0])
        choice = CHOICES[turn % len(CHOICES)]
        prompts = [llm.tokenizer.encode(render_chat(llm.tokenizer, m, offered_tools(), tool_format),
                                        add_special_tokens=False) for m in conversations]
        wanted = [params(choice, name) for name in tool_names]
        outputs = []
        for start in range(0, len(prompts), batch_size):
            outputs += [o.outputs[0] for o in llm.generate(prompts[start:start + batch_size],
                                                            wanted[start:start + batch_size])]
        for c, out in enumerate(outputs):
            parsed = bool(parse_tool_calls(out.text, tool_format, max_calls=1).calls)
            records.append(TurnRecord(c, turn, choice, out.finish_reason, list(out.token_ids), parsed))
        return [out.text for out in outputs]

    return generate


def play(llm: LLM, num_conversations: int, num_turns: int, max_tokens: int, batch_size: int,
         seed: int = 0) -> list[TurnRecord]:
    """The records of every turn of ``num_conversations`` agent conversations on ``llm``."""
    records: list[TurnRecord] = []
    tool_format = choose_tool_format("auto", llm.tokenizer.chat_template)
    generate = agent_generator(llm, tool_format, max_tokens, batch_size, records)
    build_conversations(human_eval_problems(), generate, num_conversations, num_turns, seed, tool_format)
    return records


def compare(records: list[TurnRecord], plain: list[TurnRecord]) -> dict:
    """What ``records`` did, and how many of its turns equal ``plain``'s, each conversation
    counted up to its first turn that differs."""
    reference = {(r.conversation, r.turn): r.token_ids for r in plain}
    same, first_differences, diverged = 0, [], set()
    for r in sorted(records, key=lambda r: (r.conversation, r.turn)):
        if r.conversation in diverged:
            continue
        if reference.get((r.conversation, r.turn)) == r.token_ids:
            same += 1
        else:
            diverged.add(r.conversation)
            first_differences.append({"conversation": r.conversation, "turn": r.turn, "choice": r.choice})
    forced = [r for r in records if r.choice != "auto"]
    finishes: dict[str, int] = {}
    for r in records:
        finishes[r.finish_reason] = finishes.get(r.finish_reason, 0) + 1
    return {"turns": len(records), "same_as_plain": same, "first_differences": first_differences,
            "forced_calls": len(forced), "forced_parsed": sum(r.parsed for r in forced),
            "auto_parsed": sum(r.parsed for r in records if r.choice == "auto"),
            "dead_ends": sum(r.finish_reason == DEAD_END for r in records), "finish_reasons": finishes,
            "output_tokens": sum(len(r.token_ids) for r in records)}


def engine_configs(config: TandemConfig, methods: list[str], batch_invariant: bool, max_num_seqs: int,
                   max_model_len: int) -> dict[str, TandemConfig]:
    """Plain decoding, then one config per method: ``shipped`` is the config's own speculation,
    another name the config's speculative section with that method. Batch-invariant engines run the
    full-precision model (``model.quantization: none``, whatever the config's)."""
    precision = {"quantization": "none"} if batch_invariant else {}
    base = with_overrides(config, batch_invariant=batch_invariant, max_model_len=max_model_len,
                          max_num_seqs=max(max_num_seqs, config.scheduler.max_num_seqs), **precision)
    configs = {"plain": with_overrides(base, method="none")}
    for method in methods:
        name = f"shipped ({config.speculative.method})" if method == "shipped" else method
        configs[name] = base if method == "shipped" else with_overrides(base, method=method)
    return configs


def add_agent_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default="configs/local.yaml", help="engine settings (default: local)")
    parser.add_argument("--methods", default="shipped,suffix",
                        help="comma-separated speculation methods beside plain decoding; shipped: the config's own "
                             "(default shipped,suffix)")
    parser.add_argument("--num-conversations", type=positive_int, default=50, help="conversations (default 50)")
    parser.add_argument("--num-turns", type=positive_int, default=4, help="assistant turns each (default 4)")
    parser.add_argument("--max-tokens", type=positive_int, default=192, help="per assistant turn (default 192)")
    parser.add_argument("--batch-size", type=positive_int, default=1,
                        help="conversations decoded at once (default 1: one request at a time)")
    parser.add_argument("--max-model-len", type=positive_int, default=8192,
                        help="conversations grow past the config's usual 2048 tokens (default 8192, SmolLM2's)")
    parser.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false",
                        help="leave model.batch_invariant as the config has it")


def measure_agent(args: argparse.Namespace, console: Console) -> dict:
    config = load_config(args.config)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    engines = {}
    plain: list[TurnRecord] = []
    for name, engine_config in engine_configs(config, methods, args.batch_invariant, args.batch_size,
                                                      args.max_model_len).items():
        console.print(f"[bold]{name}[/]: {args.num_conversations} conversations x {args.num_turns} turns")
        llm = LLM(config=engine_config)
        try:
            started = time.perf_counter()
            records = play(llm, args.num_conversations, args.num_turns, args.max_tokens, args.batch_size)
            seconds = time.perf_counter() - started
            spec = llm.engine.spec_stats
            drafted, accepted = spec.num_draft_tokens, spec.num_accepted_tokens
        finally:
            llm.engine.worker.close()
        plain = records if name == "plain" else plain
        engines[name] = {**compare(records, plain), "seconds": seconds, "draft_tokens": drafted,
                         "accepted_tokens": accepted, "records": [asdict(r) for r in records]}
    return {"config": str(args.config), "num_conversations": args.num_conversations, "num_turns": args.num_turns,
            "max_tokens": args.max_tokens, "max_model_len": args.max_model_len, "batch_size": args.batch_size, "batch_invariant": args.batch_invariant,
            "dtype": str(config.model.dtype), "threads": torch.get_num_threads(), "choices": list(CHOICES),
            "engines": engines}


def print_agent(console: Console, result: dict) -> None:
    table = Table(title=f"agent conversations, speculation against plain decoding ({result['config']}, "
                        f"{result['num_conversations']} x {result['num_turns']} turns, tool_choice "
                        f"{' / '.join(result['choices'])}, batch {result['batch_size']}, batch-invariant "
                        f"{'on' if result['batch_invariant'] else 'off'}, {result['threads']} threads)")
    for column in ("engine", "turns", "same as plain", "forced calls parsed", "auto calls", "dead ends",
                   "finish reasons", "accepted", "tok/s"):
        table.add_column(column, justify="right")
    for name, e in result["engines"].items():
        accepted = f"{e['accepted_tokens'] / e['draft_tokens']:.0%}" if e["draft_tokens"] else "-"
        finishes = ", ".join(f"{k} {v}" for k, v in sorted(e["finish_reasons"].items()))
        table.add_row(name, str(e["turns"]), str(e["same_as_plain"]), f"{e['forced_parsed']}/{e['forced_calls']}",
                      str(e["auto_parsed"]), str(e["dead_ends"]), finishes, accepted,
                      f"{e['output_tokens'] / e['seconds']:.1f}")
    console.print(table)
    for name, e in result["engines"].items():
        for d in e["first_differences"][:5]:
            console.print(f"  {name}: conversation {d['conversation']} first differs at turn {d['turn']} "
                          f"({d['choice']})")


AGENT = Benchmark("agent", "agent conversations (named, required and auto tool calls over long tool results): "
                  "speculation against plain decoding, token for token", add_agent_args, measure_agent, print_agent)
