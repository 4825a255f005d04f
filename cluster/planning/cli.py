"""``tandem config check CONFIG``: the memory plan of a settings file."""

from __future__ import annotations

import argparse

from cluster.config import load_config
from cluster.planning.memory_plan import format_plans, plan_memory


def cmd_config_check(args: argparse.Namespace) -> int:
    """Print each group's memory plan; exit 1 when a group cannot fit its device."""
    plans = plan_memory(load_config(args.config))
    print(format_plans(plans))
    return 1 if any(p.problem for p in plans) else 0


def add_config_parser(sub) -> None:
    config_cmd = sub.add_parser("config", help="settings files").add_subparsers(dest="config_cmd", required=True)
    check = config_cmd.add_parser("check", help="memory per group and rank (weights, KV cache, activations) "
                                                "against the device kind; exit 1 if a group cannot fit")
    check.add_argument("config", help="YAML settings file")
    check.set_defaults(func=cmd_config_check)
