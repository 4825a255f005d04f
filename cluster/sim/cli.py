"""``tandem sim CONFIG``: simulate the cluster of a ``configs/sim/*.yaml`` file.

Runs every router with the baseline controller and every controller with the baseline
router over the same seeded workload, prints the table, writes the JSON and the plots.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cluster.sim.config import load_sim_config, sim_config_from_dict
from cluster.sim.report import print_report, write_json, write_plots
from cluster.sim.runner import prepare, run_cells
from cluster.sim.validation import compare, print_comparison


def run_sim(args: argparse.Namespace) -> list[dict]:
    config = load_sim_config(args.config)
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
    if args.measured:
        comparison = compare(args.measured, summaries)
        print_comparison(comparison)
    json_path = args.json or Path(f"sim-{config.name}.json")
    write_json(json_path, config, prepared.models, prepared.capacity_rps, summaries, comparison)
    print(f"wrote {json_path}")
    if not args.no_plots:
        for path in write_plots(summaries, args.plots, config.name):
            print(f"wrote {path}")
    return summaries


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
    add("--measured", type=Path, help="a `tandem bench router --json` file of the same cluster: print the error "
        "of each simulated percentile against it")
    add("--disable-tqdm", action="store_true")


def add_sim_parser(sub) -> None:
    sim = sub.add_parser("sim", help="simulate a large heterogeneous cluster: router and controller policies")
    add_sim_args(sim)
    sim.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    run_sim(args)
    return 0
