"""``tandem bench ...``: every benchmark registered on the one skeleton of
:mod:`cluster.bench.benchmark`, ``tandem bench show`` to print a saved result again, and
``tandem bench tables`` to make the docs' tables from kept results. (``bench router`` needs Ray
and is registered by ``cluster/cli.py`` from ``deployments/``.)"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from cluster.bench.agent import AGENT
from cluster.bench.benchmark import Benchmark, add_benchmark, publish
from cluster.bench.doc_tables import refresh_docs
from cluster.bench.long_context import LONG_CONTEXT
from cluster.bench.lora import LORA
from cluster.bench.offline import OFFLINE
from cluster.bench.paper import PAPER
from cluster.bench.prefill import PREFILL
from cluster.bench.prefix import PREFIX
from cluster.bench.quant import QUANT
from cluster.bench.serve import SERVE
from cluster.bench.served import SERVED
from cluster.bench.spec import SPEC
from cluster.bench.structured import STRUCTURED

BENCHMARKS = {b.name: b for b in (OFFLINE, PREFIX, PREFILL, SPEC, PAPER, QUANT, LORA, SERVE, SERVED, STRUCTURED, AGENT,
                                  LONG_CONTEXT)}


def add_bench_parser(sub):
    """Register ``tandem bench``, its benchmarks and ``show``; returns the benchmarks' subparsers."""
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    for benchmark in BENCHMARKS.values():
        add_benchmark(bench, benchmark)
    show = bench.add_parser("show", help="print a saved result's tables again (and draw its figures with --plots)")
    show.add_argument("result", type=Path, help="the JSON a tandem bench command wrote")
    show.add_argument("--plots", type=Path, help="draw the benchmark's figures into this folder")
    show.set_defaults(func=_show, benchmarks=dict(BENCHMARKS))
    tables = bench.add_parser("tables", help="make the docs' figure tables again from their kept records")
    tables.add_argument("--docs", type=Path, default=Path("docs"),
                        help="the chapters' folder (default docs; the README beside it too)")
    tables.add_argument("--check", action="store_true", help="write nothing; fail where a table differs")
    tables.set_defaults(func=_tables)
    return bench


def register_benchmark(bench, benchmark: Benchmark) -> None:
    """Add a benchmark defined outside this package (``bench router``) to the parsers
    ``add_bench_parser`` made; their ``show`` then knows it too."""
    add_benchmark(bench, benchmark)
    bench.choices["show"].get_default("benchmarks")[benchmark.name] = benchmark


def _tables(args: argparse.Namespace) -> int:
    stale = refresh_docs(args.docs, check=args.check)
    for path in stale:
        print(f"{path}: {'differs from its records' if args.check else 'tables made again'}")
    return 1 if args.check and stale else 0


def _show(args: argparse.Namespace) -> int:
    try:
        result = json.loads(args.result.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {args.result} as a benchmark result: {err}") from err
    known = args.benchmarks
    name = result.get("run", {}).get("benchmark") if isinstance(result, dict) else None
    if name not in known:
        raise ValueError(f"{args.result} names no known benchmark in run.benchmark (got {name!r}); results "
                         f"written by tandem bench {' / '.join(known)} carry it")
    publish(known[name], result, Console(), None, args.plots)
    return 0
