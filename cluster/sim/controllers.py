"""A replica's speculation controller, built as ``cluster.spec_decode.factory`` builds it.

The simulator drives the real controllers of :mod:`cluster.spec_decode.controller`: they see a
``BatchState`` per step and, for the adaptive one, what ``Engine.step`` hands it per
decoding step (the step's seconds and each request's drafted and accepted tokens).

:class:`SimAdaptiveController` is the real ``AdaptiveController`` (its choice with
hysteresis, dwell and exploration are inherited, not re-written) with its per-step
learning written for numpy, so a million requests fit in minutes:

* the per-position acceptance EMA over a step's requests, taken in request order, is
  the closed form of the same recurrence: after n samples h_1..h_n at rate r,
  a_n = (1 - r)^n a_0 + sum_i r (1 - r)^(n - i) h_i (powers of 1 - r from a table);
* the least-squares refit is the original's, but calls the LAPACK solver
  ``np.linalg.solve`` calls without its argument checks (a result that is not finite goes
  through ``np.linalg.solve`` again, which raises as the original does).

The acceptance agrees with the original to float rounding and the refit exactly
(tests/unit/test_sim_controllers.py).
"""

from __future__ import annotations

import numpy as np
from numpy.linalg import _umath_linalg

from cluster.sim.config import parse_controller
from cluster.spec_decode.controller import (
    AdaptiveController,
    FixedController,
    SpeculationController,
    TableController,
)
from cluster.spec_decode.latency_model import LatencyModel, power_of_two_sizes


class SimAdaptiveController(AdaptiveController):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._set_powers(512)

    def observe_arrays(self, batch_size: int, k: int, seconds: float, accepted: np.ndarray | None,
                       num_drafted: float | None = None) -> None:
        """``observe(StepObservation(batch_size, k, seconds, drafts, num_drafted))`` where request
        i was asked for k draft tokens and accepted the first ``accepted[i].sum()``
        (``accepted``: # [n, k], 1 on the accepted prefix, 0 after it) and the step verified
        ``num_drafted`` draft tokens (None: every request all k). Coverage is not learnt
        here: the simulator draws acceptance per position asked for, not proposals."""
        if accepted is not None and k > 0 and len(accepted):
            self._update_acceptance(accepted)
        self._refit(batch_size, k, seconds, num_drafted)

    @staticmethod
    def _solve(xtx: np.ndarray, xty: np.ndarray) -> np.ndarray:
        """``np.linalg.solve``'s LAPACK call without its argument checks; a result that is not
        finite goes through ``np.linalg.solve`` again, which raises as the original does."""
        theta = _umath_linalg.solve1(xtx, xty, signature="dd->d")
        return theta if np.isfinite(theta).all() else np.linalg.solve(xtx, xty)

    def _update_acceptance(self, accepted: np.ndarray) -> None:
        num_positions = min(accepted.shape[1], len(self.acceptance))  # no position beyond the drafts moves
        if len(accepted) >= len(self._keep_powers):
            self._set_powers(len(accepted))
        hit = accepted[:, :num_positions].astype(bool, copy=False)  # [n, positions]: sampled and accepted
        sampled = np.ones(hit.shape, dtype=bool)  # [n, positions]: position j reached (all before it accepted)
        sampled[:, 1:] = hit[:, :-1]
        seen = sampled.cumsum(axis=0)  # samples so far, per position
        count = seen[-1]
        gained = np.add.reduce(self._weighted_powers[count - seen], axis=0, where=hit)
        current = np.array(self.acceptance[:num_positions])
        self.acceptance[:num_positions] = (self._keep_powers[count] * current + gained).tolist()

    def _set_powers(self, max_samples: int) -> None:
        """(1 - r)^m and r (1 - r)^m for m <= max_samples, computed as the closed form reads."""
        self._keep_powers = (1.0 - self.acceptance_ema) ** np.arange(max_samples + 1)
        self._weighted_powers = self.acceptance_ema * self._keep_powers


def build_controller(name: str, prior: LatencyModel, acceptance: list[float], max_k: int, max_num_seqs: int,
                     profile_table: dict[int, int] | None = None, hysteresis: float = 0.05,
                     coverage: list[float] | None = None) -> SpeculationController:
    """``name`` is ``adaptive``, ``table`` or ``fixed:K``. The table is the profile's when
    given (capped at ``max_k``, as the factory does), else solved from ``prior`` (with
    ``coverage``: n-gram lookup's share of positions proposed, None for full drafts)."""
    policy, k = parse_controller(name)
    if policy == "fixed":
        return FixedController(k)
    if policy == "table":
        if profile_table:
            return TableController({b: min(best, max_k) for b, best in profile_table.items()})
        return TableController({b: prior.best_k(b, acceptance, max_k, coverage)
                                for b in power_of_two_sizes(max_num_seqs)})
    return SimAdaptiveController(prior, acceptance, max_k, hysteresis=hysteresis, coverage=coverage)
