"""``tandem sim CONFIG``: simulate the cluster of a ``configs/sim/*.yaml`` file.

Runs every router with the baseline controller and every controller with the baseline
router over the same seeded workload, prints the table, writes the JSON and the plots.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from cluster.sim.config import load_sim_config, sim_config_from_dict
from cluster.sim.report import print_report, write_json, write_plots
from cluster.sim.runner import prepare, run_cells
from cluster.sim.step_validation import compare_steps, compare_traffic, is_paper_result, print_step_comparison
from cluster.sim.validation import compare, print_comparison


def run_sim(args: argparse.Namespace) -> list[dict]:
    config = load_sim_config(args.config)
    measured = read_measured(args.measured) if args.measured else None  # refused before simulating
    if args.num_requests or args.seed is not None or args.routers or args.controllers:
        data = config.model_dump()
        if args.num_requests:
            data["workload"]["num_requests"] = args.num_requests
        if args.seed is not None:
            data["seed"] = args.seed
        if args.routers:
            data["routers"] = args.routers.split(",")
        if args.controllers:
            data["controllers"] = args.controllers.split(",")
        config = sim_config_from_dict(data, f"{args.config} (with command-line overrides)")
    prepared = prepare(config)
    summaries = run_cells(config, prepared, show_progress=not args.disable_tqdm)
    print_report(config, prepared.models, prepared.capacity_rps, summaries)
    comparison = None
    if measured is not None:
        if is_paper_result(measured):
            comparison = {"steps": compare_steps(measured, config, prepared.models),
                          "traffic": compare_traffic(measured, config, summaries)}
            print_step_comparison(Console(width=None if Console().is_terminal else 160), comparison["steps"],
                                  comparison["traffic"])
        else:
            comparison = compare(measured, summaries)
            print_comparison(comparison)
    json_path = args.json or Path(f"sim-{config.name}.json")
    write_json(json_path, config, prepared.models, prepared.capacity_rps, summaries, comparison)
    print(f"wrote {json_path}")
    if not args.no_plots:
        for path in write_plots(summaries, args.plots, config.name):
            print(f"wrote {path}")
    return summaries


def read_measured(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--measured {path}: cannot read it as JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--measured {path}: expected a JSON object, got {type(data).__name__}")
    return data


def add_sim_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("config", help="simulation YAML, e.g. configs/sim/hetero-80.yaml")
    add("--json", type=Path, help="where to write the results (default sim-<name>.json)")
    add("--plots", type=Path, default=Path("sim-plots"), help="directory for the PNG plots")
    add("--no-plots", action="store_true")
    add("--num-requests", type=int, help="override workload.num_requests")
    add("--seed", type=int, help="override seed")
    add("--routers", help="override routers, comma-separated (tandem,pow2,round-robin,prefix-affinity)")
    add("--controllers", help="override controllers, comma-separated (adaptive,table,fixed:K)")
    add("--measured", type=Path, help="a `tandem bench router --json` file of the same cluster (the error of each "
        "simulated percentile), or a `tandem bench paper --json` file (the error of each simulated step time against "
        "the engine's decoding steps, and of each policy's mean TPOT)")
    add("--disable-tqdm", action="store_true")


def add_sim_parser(sub) -> None:
    sim = sub.add_parser("sim", help="simulate a large heterogeneous cluster: router and controller policies")
    add_sim_args(sim)
    sim.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    run_sim(args)
    return 0
