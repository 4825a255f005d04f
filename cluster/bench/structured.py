"""``tandem bench structured``: the cost of constrained decoding against free decoding.

At each batch size, the same number of requests (all at once, on one engine built from the
config) decode the same number of tokens twice: free (EOS ignored) and constrained by a JSON
schema that admits no end before ``--output-len`` tokens (an array of at least 64 objects), so
both cells emit exactly ``batch x output_len`` tokens. Rounds alternate free and constrained;
the table gives each cell's median output tok/s, the slowdown, and the share of the
constrained cell's time spent in the grammar code (masks, draft checks, consuming tokens).

Two engines: one without speculation, where every step emits one token per request whatever
the text, so the difference is the grammar's own cost; and the config's own speculation, where
the texts differ in how well they draft (JSON repeats its keys, which n-gram lookup drafts).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from cluster.bench.args import int_list, positive_int
from cluster.bench.benchmark import Benchmark
from cluster.config import load_config, with_overrides
from cluster.engine.llm import LLM, apply_chat_template
from cluster.shared.sampling_params import SamplingParams
from cluster.structured.constraint import StructuredOutputs

LONG_SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "minItems": 64, "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "city": {"type": "string", "maxLength": 12}},
        "required": ["name", "age", "city"], "additionalProperties": False}}},
    "required": ["people"],
    "additionalProperties": False,
}
PROMPT = "List 64 people with their name, age and city as JSON."


def add_structured_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default="configs/local.yaml", help="engine settings (default: local)")
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 8, 32], help="comma-separated (default 1,8,32)")
    parser.add_argument("--output-len", type=positive_int, default=128, help="tokens per request (default 128)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1, seeded)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="rounds of free + constrained per batch size")


def _round(llm: LLM, prompt: str, batch: int, args, constrained: bool) -> dict:
    constraint = StructuredOutputs(json=LONG_SCHEMA) if constrained else None
    params = [SamplingParams(max_tokens=args.output_len, temperature=args.temperature, seed=i, ignore_eos=True,
                             structured_outputs=constraint) for i in range(batch)]
    grammar_before = llm.engine.grammars.seconds
    started = time.perf_counter()
    outputs = llm.generate([prompt] * batch, params)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    if tokens != batch * args.output_len:
        raise RuntimeError(f"a request ended early ({tokens} of {batch * args.output_len} tokens): the schema "
                           "should admit no end before --output-len")
    if constrained:
        for o in outputs:
            if not o.outputs[0].text.startswith('{"people": [{"name": "'):
                raise RuntimeError(f"a constrained output does not follow the schema: {o.outputs[0].text[:80]!r}")
    return {"tok_s": tokens / seconds, "seconds": seconds,
            "grammar_seconds": llm.engine.grammars.seconds - grammar_before}


def measure_structured(args: argparse.Namespace, console: Console) -> dict:
    """Free and constrained rounds per batch size, without and with the config's speculation."""
    config = load_config(args.config)
    cells = []
    for speculation in dict.fromkeys(("none", config.speculative.method)):
        cells += _cells(LLM(config=with_overrides(config, method=speculation)), speculation, args)
    return {"config": str(args.config), "output_len": args.output_len, "temperature": args.temperature,
            "repeats": args.repeats, "threads": torch.get_num_threads(), "controller": config.speculative.controller,
            "cells": cells}


def _cells(llm: LLM, speculation: str, args) -> list[dict]:
    prompt = apply_chat_template(llm.engine.tokenizer, [{"role": "user", "content": PROMPT}])
    _round(llm, prompt, 2, argparse.Namespace(**{**vars(args), "output_len": 8}), True)  # warm-up, vocabulary
    cells = []
    for batch in args.batch_sizes:
        rounds = {"free": [], "constrained": []}
        for _ in range(args.repeats):
            for kind in ("free", "constrained"):
                rounds[kind].append(_round(llm, prompt, batch, args, kind == "constrained"))
        free = statistics.median(r["tok_s"] for r in rounds["free"])
        constrained = statistics.median(r["tok_s"] for r in rounds["constrained"])
        grammar_share = sum(r["grammar_seconds"] for r in rounds["constrained"]) / sum(
            r["seconds"] for r in rounds["constrained"])
        cells.append({"speculation": speculation, "batch_size": batch, "free_tok_s": free,
                      "constrained_tok_s": constrained, "slowdown": 1 - constrained / free,
                      "grammar_share": grammar_share, "rounds": rounds})
    return cells


def print_structured(console: Console, result: dict) -> None:
    table = Table(title=f"constrained vs free decoding ({result['config']}, {result['output_len']} tokens, "
                        f"temperature {result['temperature']}, {result['threads']} threads, "
                        f"median of {result['repeats']})")
    for column in ("speculation", "batch", "free tok/s", "constrained tok/s", "slower", "in grammar code"):
        table.add_column(column, justify="right")
    for c in result["cells"]:
        table.add_row(c["speculation"], str(c["batch_size"]), f"{c['free_tok_s']:.1f}", f"{c['constrained_tok_s']:.1f}",
                      f"{100 * c['slowdown']:.1f}%", f"{100 * c['grammar_share']:.1f}%")
    console.print(table)


STRUCTURED = Benchmark("structured", "constrained (JSON schema) against free decoding, per batch size",
                       add_structured_args, measure_structured, print_structured)
