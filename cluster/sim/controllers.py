"""A replica's speculation controller, built as ``cluster.spec.factory`` builds it.

The simulator drives the real controllers of :mod:`cluster.spec.controller`: they
see a ``BatchState`` per step and, for the adaptive one, a ``StepObservation`` per
decoding step (simulated seconds and per-request (drafted, accepted) counts), exactly
what ``Engine.step`` hands them.
"""

from __future__ import annotations

from cluster.sim.config import parse_controller
from cluster.spec.controller import AdaptiveController, FixedController, SpeculationController, TableController
from cluster.spec.latency_model import LatencyModel, power_of_two_sizes


def build_controller(name: str, prior: LatencyModel, acceptance: list[float], max_k: int, max_num_seqs: int,
                     profile_table: dict[int, int] | None = None, hysteresis: float = 0.05) -> SpeculationController:
    """``name`` is ``adaptive``, ``table`` or ``fixed:K``. The table is the profile's when
    given (capped at ``max_k``, as the factory does), else solved from ``prior``."""
    policy, k = parse_controller(name)
    if policy == "fixed":
        return FixedController(k)
    if policy == "table":
        if profile_table:
            return TableController({b: min(best, max_k) for b, best in profile_table.items()})
        return TableController({b: prior.best_k(b, acceptance, max_k) for b in power_of_two_sizes(max_num_seqs)})
    return AdaptiveController(prior, acceptance, max_k, hysteresis=hysteresis)
