"""The one skeleton every ``tandem bench`` command runs on.

A :class:`Benchmark` is four functions: its arguments, a measurement that returns the JSON
result, tables printed from that result alone, and (optionally) figures drawn from it. The
skeleton gives each command the same ``--json`` and ``--plots`` options, stamps every result
with how and where it was made (``result["run"]``, see :mod:`cluster.bench.run_info`), prints,
writes, and draws, in that order. Because tables and figures read only the JSON,
``tandem bench show FILE`` prints (and draws) any saved result again.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from cluster.bench.run_info import finish_run_info, start_run_info


@dataclass(frozen=True)
class Benchmark:
    name: str
    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    measure: Callable[[argparse.Namespace, Console], dict]
    report: Callable[[Console, dict], None]
    plots: Callable[[dict, Path], list[Path]] | None = None
    plots_help: str = "write PNG figures into this folder"
    default_json: Path | None = None  # None: the JSON is written only when --json is given


def add_benchmark(subparsers, benchmark: Benchmark) -> argparse.ArgumentParser:
    """Register ``benchmark`` as a subcommand with its own arguments and the shared ones."""
    parser = subparsers.add_parser(benchmark.name, help=benchmark.help)
    benchmark.add_args(parser)
    default = f" (default {benchmark.default_json})" if benchmark.default_json else ""
    parser.add_argument("--json", type=Path, default=benchmark.default_json,
                        help=f"write the result here{default}")
    if benchmark.plots is not None:
        parser.add_argument("--plots", type=Path, help=benchmark.plots_help)
    parser.set_defaults(func=lambda args: _exit_zero(run_benchmark(benchmark, args)))
    return parser


def run_benchmark(benchmark: Benchmark, args: argparse.Namespace, console: Console | None = None) -> dict:
    """Measure, stamp, print, write the JSON (when asked or by default) and draw (when asked)."""
    console = console or Console()
    started = start_run_info(benchmark.name, getattr(args, "argv", None))
    clock = time.perf_counter()
    result = benchmark.measure(args, console)
    result["run"] = finish_run_info(started, time.perf_counter() - clock)
    publish(benchmark, result, console, args.json, getattr(args, "plots", None))
    return result


def publish(benchmark: Benchmark, result: dict, console: Console, json_path: Path | None,
            plots: Path | None) -> None:
    """Print ``result``'s tables; write it to ``json_path`` and its figures into ``plots`` where given."""
    benchmark.report(console, result)
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"wrote {json_path}")
    if plots is not None:
        if benchmark.plots is None:
            raise ValueError(f"tandem bench {benchmark.name} draws no figures; drop --plots")
        for path in benchmark.plots(result, plots):
            console.print(f"wrote {path}")


def _exit_zero(_result: dict) -> int:
    return 0
