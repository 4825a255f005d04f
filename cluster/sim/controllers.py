"""A replica's speculation controller, built as ``cluster.spec.factory`` builds it.

The simulator drives the real controllers of :mod:`cluster.spec.controller`: they see a
``BatchState`` per step and, for the adaptive one, what ``Engine.step`` hands it per
decoding step (the step's seconds and each request's drafted and accepted tokens).

:class:`SimAdaptiveController` is the real ``AdaptiveController`` (its choice with
hysteresis, dwell and exploration, and its least-squares refit, are inherited, not
re-written) with its two per-step loops in numpy, so a million requests fit in minutes:

* the per-position acceptance EMA over a step's requests, taken in request order, is
  the closed form of the same recurrence: after n samples h_1..h_n at rate r,
  a_n = (1 - r)^n a_0 + sum_i r (1 - r)^(n - i) h_i;
* ``best_k`` evaluates TPOT(b, k) for all k in one loop of floats (:class:`VectorLatencyModel`).

Both agree with the originals to float rounding (tests/unit/test_sim_controllers.py).
"""

from __future__ import annotations

import numpy as np

from cluster.sim.config import parse_controller
from cluster.spec.controller import (
    AdaptiveController,
    FixedController,
    SpeculationController,
    StepObservation,
    TableController,
)
from cluster.spec.latency_model import LatencyModel, power_of_two_sizes


class VectorLatencyModel(LatencyModel):
    """``LatencyModel`` whose ``best_k`` runs in one loop of floats (no numpy per k)."""

    def best_k(self, batch_size: int, acceptance: list[float], max_k: int) -> int:
        c0, c1, c2 = self.target_coef
        d0, d1 = self.draft_coef
        base = c0 + c1 * batch_size + c2 * batch_size  # k = 0
        per_k = d0 + d1 * batch_size + c2 * batch_size  # one more draft pass and verified token
        best, best_cost = 0, base
        tokens, survive = 1.0, 1.0
        for k in range(1, max_k + 1):
            rate = acceptance[min(k - 1, len(acceptance) - 1)] if acceptance else 0.0
            survive *= min(max(rate, 0.0), 1.0)
            tokens += survive
            cost = (base + k * per_k) / tokens
            if cost < best_cost:
                best, best_cost = k, cost
        return best


class SimAdaptiveController(AdaptiveController):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.model = VectorLatencyModel(list(self.model.target_coef), list(self.model.draft_coef))

    def observe_arrays(self, batch_size: int, k: int, seconds: float, accepted: np.ndarray | None) -> None:
        """``observe(StepObservation(batch_size, k, seconds, [(k, a) for a in accepted]))``."""
        if accepted is not None and k > 0 and len(accepted):
            self._update_acceptance(k, accepted)
        super().observe(StepObservation(batch_size, k, seconds, []))
        if type(self.model) is not VectorLatencyModel:
            self.model = VectorLatencyModel(list(self.model.target_coef), list(self.model.draft_coef))

    def _update_acceptance(self, drafted: int, accepted: np.ndarray) -> None:
        positions = np.arange(min(drafted, len(self.acceptance)))  # no position beyond the drafts moves
        reached = np.minimum(np.minimum(accepted + 1, drafted), len(self.acceptance))  # [n]
        mask = positions[None, :] < reached[:, None]  # [n, positions]: sample of position j
        hit = positions[None, :] < accepted[:, None]
        count = mask.sum(axis=0)
        later = count[None, :] - np.cumsum(mask, axis=0)  # samples after this one, per position
        keep = 1.0 - self.acceptance_ema
        gained = (self.acceptance_ema * keep ** later * (mask & hit)).sum(axis=0)
        current = np.array(self.acceptance[: len(positions)])
        self.acceptance[: len(positions)] = (keep ** count * current + gained).tolist()


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
    return SimAdaptiveController(prior, acceptance, max_k, hysteresis=hysteresis)
