"""Builders shared by the simulator's tests (no tests here): configs, step models and workloads by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cluster.sim.config import SimConfig, sim_config_from_dict
from cluster.sim.device_model import StepModel
from cluster.sim.engine import SimResult, Simulation
from cluster.sim.workload import Workload
from cluster.spec_decode.latency_model import LatencyModel

DEVICES = str(Path(__file__).resolve().parents[2] / "configs" / "sim" / "devices.yaml")


def sim_config(groups: list[dict], **overrides) -> SimConfig:
    data = {
        "devices": DEVICES,
        "target": {"name": "t", "num_params_b": 8.0, "kv_bytes_per_token": 131072},
        "acceptance": [0.5],
        "groups": groups,
        "workload": {"rate": 1.0},
        **overrides,
    }
    return sim_config_from_dict(data, "test")


def constant_model(step_s: float, acceptance=(0.0,), kv_capacity: int = 10**9, max_k: int = 6,
                   per_token_s: float = 0.0) -> StepModel:
    """Every step takes ``step_s`` (+ ``per_token_s`` per token computed)."""
    return StepModel(LatencyModel([step_s, 0.0, per_token_s], [0.0, 0.0]), tuple(acceptance), kv_capacity,
                     "measured: by hand", 1.0, max_k)


def workload(arrivals, prompt_len, output_len, prefix_id=None, shared_len=None) -> Workload:
    n = len(arrivals)
    as_array = lambda v, fill: np.asarray(v if v is not None else [fill] * n, dtype=np.int64)  # noqa: E731
    prompt = np.broadcast_to(np.asarray(prompt_len, dtype=np.int64), (n,)).copy()
    output = np.broadcast_to(np.asarray(output_len, dtype=np.int64), (n,)).copy()
    return Workload(np.asarray(arrivals, dtype=np.float64), prompt, output, as_array(prefix_id, -1),
                    as_array(shared_len, 0))


def run(config: SimConfig, models: dict[str, StepModel], load: Workload, router: str = "tandem",
        controller: str = "fixed:0") -> SimResult:
    return Simulation(config, models, load, router, controller, check_invariants=True).run()
