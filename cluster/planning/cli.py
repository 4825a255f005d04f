"""``tandem config check CONFIG``: the memory plan of a settings file."""

from __future__ import annotations

import argparse

from cluster.config import TandemConfig, group_engine_config, load_config
from cluster.planning.memory_plan import format_plans, plan_memory
from cluster.spec_decode.suffix import suffix_problem


def cmd_config_check(args: argparse.Namespace) -> int:
    """Print each group's memory plan and what its speculation method lacks here; exit 1 when a
    group cannot fit its device or cannot run its method."""
    config = load_config(args.config)
    plans = plan_memory(config)
    print(format_plans(plans))
    problems = speculation_problems(config)
    for line in problems:
        print(line)
    return 1 if any(p.problem for p in plans) or problems else 0


def speculation_problems(config: TandemConfig) -> list[str]:
    """One line per replica group (or the engine, without groups) whose speculation method cannot
    run in this environment (a vLLM group's runs in the same one)."""
    named = [(g.name, group_engine_config(config, g.name)) for g in config.serve.groups] or [("engine", config)]
    problem = suffix_problem()
    return [f"{name}: {problem}" for name, c in named if c.speculative.method == "suffix" and problem]


def add_config_parser(sub) -> None:
    config_cmd = sub.add_parser("config", help="settings files").add_subparsers(dest="config_cmd", required=True)
    check = config_cmd.add_parser("check", help="memory per group and rank (weights, KV cache, activations) "
                                                "against the device kind; exit 1 if a group cannot fit")
    check.add_argument("config", help="YAML settings file")
    check.set_defaults(func=cmd_config_check)
