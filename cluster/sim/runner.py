"""One ``tandem sim`` run: step models, the workload, and a run per (router, controller) cell.

The cells are every router with ``baseline_controller`` and every controller with
``baseline_router`` (the baseline pair once): the two comparisons the report makes,
without the full cross product. All cells replay the same workload.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.sim.config import SimConfig
from cluster.sim.device_model import DeviceTable, StepModel, group_step_model, peak_requests_per_s
from cluster.sim.engine import simulate
from cluster.sim.metrics import summarize
from cluster.sim.workload import Workload, build_workload, mean_lengths


@dataclass(frozen=True)
class Prepared:
    models: dict[str, StepModel]
    capacity_rps: float  # requests/s the initial cluster sustains (what ``load`` is a fraction of)
    workload: Workload


def initial_replicas(config: SimConfig) -> dict[str, int]:
    return {g.name: (g.autoscaling.initial_replicas if g.autoscaling and g.autoscaling.initial_replicas is not None
                     else g.autoscaling.min_replicas if g.autoscaling else g.num_replicas)
            for g in config.groups}


def prepare(config: SimConfig) -> Prepared:
    table = DeviceTable.load(config.devices)
    models = {g.name: group_step_model(config, g, table) for g in config.groups}
    mean_prompt, mean_output = mean_lengths(config.workload, config.seed)
    counts = initial_replicas(config)
    capacity = sum(max(counts[g.name], 1) * peak_requests_per_s(models[g.name], g.max_num_seqs, mean_prompt,
                                                                  mean_output, g.step_time_scale)
                   for g in config.groups)
    return Prepared(models, capacity, build_workload(config.workload, config.seed, capacity))


def cells(config: SimConfig) -> list[tuple[str, str]]:
    pairs = [(router, config.baseline_controller) for router in config.routers]
    pairs += [(config.baseline_router, c) for c in config.controllers if (config.baseline_router, c) not in pairs]
    return pairs


def run_cells(config: SimConfig, prepared: Prepared, show_progress: bool = False) -> list[dict]:
    summaries = []
    for router, controller in cells(config):
        result = simulate(config, prepared.models, prepared.workload, router, controller, show_progress)
        summaries.append(summarize(result, config.slo))
    return summaries
