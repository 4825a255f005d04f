"""A replica's speculation controller, built as ``cluster.spec.factory`` builds it.

The simulator drives the real controllers of :mod:`cluster.spec.controller`: they see a
``BatchState`` per step and, for the adaptive one, what ``Engine.step`` hands it per
decoding step (the step's seconds and each request's drafted and accepted tokens).

:class:`SimAdaptiveController` is the real ``AdaptiveController`` (its choice with
hysteresis, dwell and exploration are inherited, not re-written) with its per-step
learning written for numpy, so a million requests fit in minutes:

* the per-position acceptance EMA over a step's requests, taken in request order, is
  the closed form of the same recurrence: after n samples h_1..h_n at rate r,
  a_n = (1 - r)^n a_0 + sum_i r (1 - r)^(n - i) h_i (powers of 1 - r from a table);
* the least-squares refit keeps its sums as floats, updated element by element with
  the operations of ``AdaptiveController.observe`` (f * sum + x_i * x_j), and calls the
  LAPACK solver ``np.linalg.solve`` calls, without its argument checks (a result that is
  not finite goes through ``np.linalg.solve`` again, which raises as the original does);
* ``best_k`` evaluates TPOT(b, k) for all k in one loop of floats (coverage included) and the step times
  are sums of floats in ``np.dot``'s order (:class:`VectorLatencyModel`).

The acceptance agrees with the original to float rounding and the refit exactly
(tests/unit/test_sim_controllers.py).
"""

from __future__ import annotations

from itertools import product

import numpy as np
from numpy.linalg import _umath_linalg

from cluster.sim.config import parse_controller
from cluster.spec.controller import (
    AdaptiveController,
    FixedController,
    SpeculationController,
    TableController,
)
from cluster.spec.latency_model import LatencyModel, power_of_two_sizes


class VectorLatencyModel(LatencyModel):
    """``LatencyModel`` whose ``best_k`` runs in one loop of floats (no numpy per k) and
    whose step times are float sums in the order of ``np.dot`` over the features."""

    def target_time(self, batch_size: int, tokens_per_request: int) -> float:
        c0, c1, c2 = self.target_coef
        return float(c0 * 1.0 + c1 * batch_size + c2 * (batch_size * tokens_per_request))

    def draft_time(self, batch_size: int) -> float:
        d0, d1 = self.draft_coef
        return float(d0 * 1.0 + d1 * batch_size)

    def best_k(self, batch_size: int, acceptance: list[float], max_k: int,
               coverage: list[float] | None = None) -> int:
        c0, c1, c2 = self.target_coef
        d0, d1 = self.draft_coef
        base = c0 + c1 * batch_size + c2 * batch_size  # k = 0
        per_pass = d0 + d1 * batch_size  # one more draft pass
        per_token = c2 * batch_size  # one more draft token verified per request
        best, best_cost = 0, base
        tokens, survive, drafted = 1.0, 1.0, 0.0
        for k in range(1, max_k + 1):
            rate = acceptance[min(k - 1, len(acceptance) - 1)] if acceptance else 0.0
            survive *= min(max(rate, 0.0), 1.0)
            tokens += survive
            if coverage is None:
                drafted += 1.0
            elif coverage:  # as expected_drafted: positions beyond the list reuse its last value
                drafted += min(max(coverage[min(k - 1, len(coverage) - 1)], 0.0), 1.0)
            cost = (base + k * per_pass + drafted * per_token) / tokens
            if cost < best_cost:
                best, best_cost = k, cost
        return best


class SimAdaptiveController(AdaptiveController):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.model = VectorLatencyModel(list(self.model.target_coef), list(self.model.draft_coef))
        self._set_powers(512)
        self._xtx_sums = self._xtx.ravel().tolist()  # [16]: the observed steps' sums as floats
        self._xty_sums = self._xty.tolist()  # [4]
        self._prior_xtx_sums = self._prior_xtx.ravel().tolist()  # [16]
        self._prior_xty_sums = self._prior_xty.tolist()  # [4]

    def observe_arrays(self, batch_size: int, k: int, seconds: float, accepted: np.ndarray | None,
                       num_drafted: float | None = None) -> None:
        """``observe(StepObservation(batch_size, k, seconds, drafts, num_drafted))`` where request
        i was asked for k draft tokens and accepted the first ``accepted[i].sum()``
        (``accepted``: # [n, k], 1 on the accepted prefix, 0 after it) and the step verified
        ``num_drafted`` draft tokens (None: every request all k). Coverage is not learnt
        here: the simulator draws acceptance per position asked for, not proposals."""
        if accepted is not None and k > 0 and len(accepted):
            self._update_acceptance(accepted)
        if batch_size < 1 or seconds <= 0:
            return
        # _step_features / seconds and 1 - c2 D / seconds: relative errors, as observe weighs them
        x = (1.0 / seconds, float(batch_size) / seconds, float(k) / seconds, float(k * batch_size) / seconds)
        y = 1.0 - self._c2 * (batch_size * k if num_drafted is None else num_drafted) / seconds
        f = self.forgetting
        self._xtx_sums = [f * s + xi * xj for s, (xi, xj) in zip(self._xtx_sums, product(x, repeat=2))]
        self._xty_sums = [f * s + xi * y for s, xi in zip(self._xty_sums, x)]
        # scale * prior + (f * xtx + np.outer(x, x)), element by element, as observe computes it
        scale = self._prior_scale = max(f * self._prior_scale, self._prior_floor)
        xtx = np.array([scale * p + s for p, s in zip(self._prior_xtx_sums, self._xtx_sums)]).reshape(4, 4)
        xty = np.array([scale * p + s for p, s in zip(self._prior_xty_sums, self._xty_sums)])
        theta = _umath_linalg.solve1(xtx, xty, signature="dd->d")
        if not np.isfinite(theta).all():
            theta = np.linalg.solve(xtx, xty)  # raises on a singular system, as observe does
        c0, per_request, d0, d1 = (max(c, 0.0) for c in theta.tolist())  # np.clip(theta, 0, None)
        self.model = VectorLatencyModel([c0, max(per_request - self._c2, 0.0), self._c2], [d0, d1])

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
