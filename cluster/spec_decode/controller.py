"""Speculation controllers: batch state in, speculation length ``k`` out (0 = plain decoding).

- ``FixedController``: one ``k`` for every step.
- ``TableController``: the paper's policy, a profiled lookup of the best ``k`` by the
  live batch size.
- ``AdaptiveController``: starts from the profile, keeps per-position acceptance and
  the step-time model true online from the engine's own observations (exponential
  moving averages; least squares with forgetting). The step times stand on the profile's
  (its measured grid where it measured every batch size and length, as the table's do,
  else its fitted line); the least squares learn how many times slower this device runs
  them, quickly, and a correction to their shape, linear in the batch size, k and the draft
  tokens verified, slowly (a profile is often measured on another machine than the one
  serving). The first steps
  it times set the profile's unit (how many of this device's seconds its times are), so
  its prior on the shape weighs as meant whatever the profile's units (the built-in prior's
  are relative). It re-solves
  the best ``k`` for the batch at hand, and switches only when the new ``k`` is predicted
  to be clearly better and the current one has been held for a while (so ``k`` does not
  flap when the batch size sits at the edge between two best values), or at once when the
  batch has more than doubled or halved since the held one was chosen (a burst). ``k = 0``
  falls out of the model wherever drafting does not pay; a ``k`` held is left, whatever the band, as soon
  as it is predicted slower than plain decoding (on random 128-token prompts at temperature 1,
  2-core Zen 4, 2 requests/s, n-gram held k = 6 where k = 0 was predicted 2.7% faster, inside
  the band, and served TPOT came out 0.93x of speculation off). At most every
  ``explore_every`` steps it drafts one token more than the ``k`` it holds (up to
  ``max_k``), and as often, while drafting, it runs a plain step: acceptance is only
  observed at the positions drafted and step times only at the ``k`` run, so without these
  probes a profile that under-rates the deeper positions (or a recovered acceptance at
  ``k = 0``), or one that under-prices drafting on this device, would never be corrected.
  Probes are paid from a budget: each step earns
  ``explore_budget`` (up to one step's worth saved) and a probe costs its predicted step
  time over the held k's, minus one, so probes add about ``explore_budget`` at most to
  the mean step time. Where a probe is cheap (small batches) it runs every
  ``explore_every`` steps; where it is dear (a large batch drafting one more token each)
  only as often as the budget pays, so exploring does not take a loaded replica's
  throughput. Acceptance is learnt over the positions asked for (one not
  proposed counts as rejected) and, beside it, the coverage (the share of positions
  asked for that got a token): n-gram lookup often proposes fewer than ``k``, which makes
  both the step cheaper and the gain smaller than full drafts would
  (:mod:`cluster.spec_decode.latency_model`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from itertools import product
from typing import Protocol

import numpy as np

from cluster.spec_decode.latency_model import LatencyModel
from cluster.spec_decode.pass_grid import PassGrid


@dataclass(frozen=True)
class BatchState:
    num_running: int  # requests holding KV blocks, decoding or in prefill
    num_waiting: int


@dataclass(frozen=True)
class StepObservation:
    batch_size: int  # requests in the step
    k: int
    seconds: float  # wall time of the whole step (drafting included)
    # per request asked for drafts: (positions asked for, tokens proposed, tokens accepted)
    drafts: list[tuple[int, int, int]] = field(default_factory=list)
    num_drafted: int | None = None  # draft tokens the step verified (None: batch_size * k, full drafts)


class SpeculationController(Protocol):
    def choose_k(self, state: BatchState) -> int: ...

    def observe(self, obs: StepObservation) -> None:
        """A decoding step that ran (steps with prefill chunks are not reported)."""
        ...

    def k_table(self, batch_sizes: list[int]) -> dict[int, int]:
        """The k in force per batch size, without changing the controller's state."""
        ...

    def estimates(self, batch_sizes: list[int]) -> dict | None:
        """What a learning controller believes now, for the debug views (None: it learns nothing)."""
        ...


@dataclass
class FixedController:
    k: int

    def choose_k(self, state: BatchState) -> int:
        return self.k

    def observe(self, obs: StepObservation) -> None:
        """A fixed k learns nothing."""

    def k_table(self, batch_sizes: list[int]) -> dict[int, int]:
        return {b: self.k for b in batch_sizes}

    def estimates(self, batch_sizes: list[int]) -> None:
        return None


class TableController:
    """``table[b]`` is the best k for batch size ``b``; sizes between entries use the
    largest entry not above them."""

    def __init__(self, table: dict[int, int]) -> None:
        if not table:
            raise ValueError("a speculation table needs at least one batch size")
        self.sizes = sorted(table)
        self.table = dict(table)

    def choose_k(self, state: BatchState) -> int:
        i = bisect.bisect_right(self.sizes, max(1, state.num_running)) - 1
        return self.table[self.sizes[max(i, 0)]]

    def observe(self, obs: StepObservation) -> None:
        """The profiled table stands as measured."""

    def k_table(self, batch_sizes: list[int]) -> dict[int, int]:
        return {b: self.choose_k(BatchState(b, 0)) for b in batch_sizes}

    def estimates(self, batch_sizes: list[int]) -> None:
        return None


class AdaptiveController:
    def __init__(
        self,
        model: LatencyModel,
        acceptance: list[float],
        max_k: int,
        hysteresis: float = 0.05,
        coverage: list[float] | None = None,
        min_dwell_steps: int = 8,
        jump_ratio: float = 2.0,
        acceptance_ema: float = 0.01,
        forgetting: float = 0.995,
        prior_weight: float = 10.0,
        scale_prior_weight: float = 0.01,
        prior_floor: float = 1e-3,
        calibration_steps: int = 16,
        explore_every: int = 64,
        explore_budget: float = 0.001,
        grid: PassGrid | None = None,
    ) -> None:
        self.max_k = max_k
        self.hysteresis = hysteresis
        self.min_dwell_steps = min_dwell_steps
        # The dwell is for a batch sitting at an edge between two best k. A batch more than
        # ``jump_ratio`` times (or less than 1 / ``jump_ratio`` of) the one the held k was chosen
        # at has jumped (a burst arrived or drained), and the hysteresis alone decides at once:
        # on the `cpu` proportions pair a burst took the batch from 5 to 32 right after a switch,
        # and the dwell held k = 3 for 4 steps of 3.5x plain decoding's time, 8% of the heavy
        # phase's TPOT (tandem bench paper --proportions cpu on a Zen 4).
        self.jump_ratio = jump_ratio
        self._batch_at_choice = 1  # the batch size the held k was chosen at
        # The weight of one request's sample at a position: 0.01 averages over ~100 samples,
        # a few steps of a large batch (0.02 left the estimate noisy enough to flip k there).
        self.acceptance_ema = acceptance_ema
        self.explore_every = explore_every
        self.explore_budget = explore_budget
        self.forgetting = forgetting
        self.acceptance = [float(acceptance[min(j, len(acceptance) - 1)]) if acceptance else 0.5
                           for j in range(max(1, max_k))]
        self.coverage = [float(coverage[min(j, len(coverage) - 1)]) if coverage else 1.0
                         for j in range(max(1, max_k))]
        # Least squares over whole-step times, forgetting old steps. A step that verifies D
        # draft tokens at batch size b costs s P(b, k, D) + c0 + c1 b + d0 k + e D, where
        # P is the profile's time for it (its measured grid: the verifying pass at 1 + D / b
        # tokens and k draft passes; else its fitted line) and [s, c0, c1, d0, e] are learnt:
        # s how much slower or faster this device runs than the one profiled (1 at first),
        # c0..e a correction to the profile's shape (0 at first, of either sign). The model
        # composed from them predicts what the fit fitted: its terms are not clipped one by one
        # (where the batch sits at one size the fit may trade c0 against c1 b, +16 ms against
        # -3 ms a request; clipping c1 at 0 added 22 ms to every batch-8 step, which diluted
        # drafting's cost against plain decoding's, and k = 3 was held on the instruction
        # prompts at concurrency 8 at 0.91x of plain decoding's throughput); a whole step and
        # a draft pass are never predicted below 0 (LatencyModel). The last term follows the
        # draft tokens a step really verified, not k b: where drafts are partial (suffix,
        # n-gram) and each verified token costs nearly a plain row (a CPU at batch 8), a term
        # in k b could not tell a step of 9 drafted tokens from one of 50 at the same k, and
        # was up to 10% off (tests/unit/test_controller.py). For full drafts D = k b.
        self.grid = grid
        self._profile = (LatencyModel([0.0, 0.0, 0.0], [0.0, 0.0], grid) if grid is not None
                         else LatencyModel(list(model.target_coef), list(model.draft_coef)))
        self._unit = 1.0  # the profile's times in this device's seconds are unit x theirs (below)
        self.coefficients = [1.0, 0.0, 0.0, 0.0, 0.0]  # [s / unit, c0, c1, d0, e] as last solved
        self.model = self._composed(*self.coefficients)
        # The profile enters as pseudo-steps, forgotten like observed steps but never below
        # ``prior_floor`` of their weight: steps held at one k (or one batch size) leave some of
        # the sums unidentified, and a prior decaying to nothing turned the system singular
        # (after ~6,000 such steps); at the floor those sums keep the profile's values and the
        # observed ones hardly move. Two independent parts: the shape's correction is 0 with
        # the weight of ``prior_weight`` steps over a grid of (b, k), and the scale is 1 with
        # the weight of ``scale_prior_weight`` steps, a hundredth of one, so that the first
        # steps read a device that runs the profile's passes 3x slower (a CPU of the same kind
        # as the profiled one measured so); with one prior of 50
        # steps and no scale, the model still put a 51 ms step at 33 ms after 128 steps.
        sizes_ks = [(b, k) for b in (1, 2, 4, 8, 16, 32, 64) for k in range(max_k + 1)]
        features = np.array([_step_features(b, k) for b, k in sizes_ks])
        # Relative errors, as the profile was fitted (:func:`fit_linear`): each step's row is
        # scaled by 1 / its time, so a batch-32 step does not outweigh thirty batch-1 steps.
        times = np.array([max(self._profile.step_time(b, k), 1e-12) for b, k in sizes_ks])
        features = features / times[:, None]
        prior_xtx = np.zeros((5, 5))
        prior_xtx[0, 0] = scale_prior_weight
        prior_xtx[1:, 1:] = prior_weight / len(features) * features.T @ features
        prior_xtx += 1e-9 * np.eye(5)
        # The sums are kept as lists of floats (row-major 5 x 5 and 5) and updated element by
        # element: with numpy arrays ``observe`` took ~150 us a step in the engine, ~70 us so.
        self._prior_xtx = prior_xtx.ravel().tolist()
        self._prior_xty = (prior_xtx @ np.array([1.0, 0.0, 0.0, 0.0, 0.0])).tolist()
        # The profile's times in this device's seconds: ``unit`` times the profile's, set from
        # the median ratio of the first ``calibration_steps`` steps' times to the profile's (1
        # until then). Without it the corrections' prior stood in the profile's units: the
        # built-in prior's, where a target pass is 1.0, weighed about 10^-4 of a timed step of
        # 10 ms, so nothing held the corrections where a batch of one size left them unidentified
        # (s 0.03-0.05 against 0.01 and c0 -24 to -41 ms cancelling it, after a warm-up at batch
        # 8): at batch 1 that model priced one draft at +66% of a plain step and held k = 0.
        self._calibration_steps = calibration_steps
        self._calibrating: list[tuple[int, int, float, float | None]] | None = [] if calibration_steps > 0 else None
        self._prior_scale = 1.0
        self._prior_floor = prior_floor
        self._xtx = [0.0] * 25  # the observed steps' sums, forgotten at rate ``forgetting``
        self._xty = [0.0] * 5
        self.k: int | None = None
        self._steps_at_k = 0
        self._steps_since_probe = 0  # since the last up probe (or switch)
        self._steps_since_plain = 0  # since the last plain probe (or switch)
        self._probe_credit = 0.0  # in steps' worth of time; earned per step, spent by probes
        self.num_switches = 0
        self.num_probes = 0

    @classmethod
    def from_profile(cls, profile, max_k: int, **kwargs) -> "AdaptiveController":
        """Started from a :class:`~cluster.spec_decode.profile_data.SpeculationProfile`: its acceptance,
        coverage and measured grid (its fitted line where the grid lacks a length up to max_k)."""
        return cls(profile.latency_model, profile.acceptance, max_k, coverage=profile.coverage,
                   grid=profile.pass_grid(max_k), **kwargs)

    # ---- deciding ---------------------------------------------------------------------
    def choose_k(self, state: BatchState) -> int:
        b = max(1, state.num_running)
        costs = self.model.time_per_token_by_k(b, self.acceptance, self.max_k, self.coverage)
        best = costs.index(min(costs))
        if self.k is None:  # as from k = 0: drafting starts only where it is clearly ahead
            self.k = best if costs[best] < costs[0] * (1 - self.hysteresis) else 0
            self._batch_at_choice = b
        elif best != self.k and (self._steps_at_k >= self.min_dwell_steps or self._batch_jumped(b)):
            if costs[best] < costs[self.k] * (1 - self.hysteresis) or costs[self.k] > costs[0]:
                self.k, self._steps_at_k, self._steps_since_probe, self._steps_since_plain = best, 0, 0, 0
                self._batch_at_choice = b
                self.num_switches += 1
        self._steps_at_k += 1
        self._steps_since_probe += 1
        self._steps_since_plain += 1
        self._probe_credit = min(self._probe_credit + self.explore_budget, 1.0)
        probe = self._probe(b, costs)
        return self.k if probe is None else probe

    def _batch_jumped(self, b: int) -> bool:
        return b > self.jump_ratio * self._batch_at_choice or b * self.jump_ratio < self._batch_at_choice

    def _probe(self, b: int, costs: list[float]) -> int | None:
        """The k of a probe step, if one is due and the credit pays for it: one token more than
        the k held (the next position's acceptance and a longer step's time), at most every
        ``explore_every`` steps; and, while drafting, a plain step (k = 0: its time at this
        batch size), as often. Held at one k, the controller sees only that k's steps, so what
        drafting adds to a step is the profile's word alone, and a profile measured on another
        machine or context length can be wrong about it by more than drafting gains. An up probe
        costs its predicted step time over the held k's, minus one; a plain one the time its
        single token takes beyond the held k's time per token (nothing where k = 0 is predicted
        as good, which is when measuring it matters)."""
        up_due = self.k < self.max_k and self._steps_since_probe >= self.explore_every
        plain_due = self.k > 0 and self._steps_since_plain >= self.explore_every
        if not (up_due or plain_due):  # most steps: no model evaluation beyond choose_k's
            return None
        held = self.model.step_time(b, self.k, self.coverage)
        if held <= 0:
            return None
        if up_due:
            cost = max(self.model.step_time(b, self.k + 1, self.coverage) / held - 1.0, 0.0)
            if cost <= self._probe_credit:
                self._probe_credit -= cost
                self._steps_since_probe = 0
                self.num_probes += 1
                return self.k + 1
        if plain_due:
            cost = max((costs[0] - costs[self.k]) / held, 0.0)
            if cost <= self._probe_credit:
                self._probe_credit -= cost
                self._steps_since_plain = 0
                self.num_probes += 1
                return 0
        return None

    def k_table(self, batch_sizes: list[int]) -> dict[int, int]:
        """The best k per batch size under the current estimates (before hysteresis)."""
        return {b: self.model.best_k(b, self.acceptance, self.max_k, self.coverage) for b in batch_sizes}

    def estimates(self, batch_sizes: list[int]) -> dict:
        """What the controller believes now, for debugging a served engine: the k held, per-position
        acceptance and coverage, the learnt step-time coefficients ([s, c0, c1, d0, e], s the
        device's slowness against the profile, e a draft token's verification) and, per batch
        size, the predicted ms per output token of each k from 0 to max_k."""
        return {
            "k_held": self.k,
            "acceptance": [round(a, 4) for a in self.acceptance],
            "coverage": [round(c, 4) for c in self.coverage],
            "coefficients": [round(c, 6) for c in [self._unit * self.coefficients[0], *self.coefficients[1:]]],
            "num_probes": self.num_probes,
            "num_switches": self.num_switches,
            "ms_per_token_by_k": {b: [round(1000 * t, 3) for t in self.model.time_per_token_by_k(
                b, self.acceptance, self.max_k, self.coverage)] for b in batch_sizes},
        }

    # ---- learning ---------------------------------------------------------------------
    def observe(self, obs: StepObservation) -> None:
        rate = self.acceptance_ema
        for asked, proposed, accepted in obs.drafts:
            for j in range(min(accepted + 1, asked, len(self.acceptance))):
                hit = 1.0 if j < accepted else 0.0
                self.acceptance[j] += rate * (hit - self.acceptance[j])
            for j in range(min(asked, len(self.coverage))):
                self.coverage[j] += rate * ((1.0 if j < proposed else 0.0) - self.coverage[j])
        self._refit(obs.batch_size, obs.k, obs.seconds, obs.num_drafted)

    def _refit(self, batch_size: int, k: int, seconds: float, num_drafted: float | None) -> None:
        """Add one step to the least-squares sums (forgetting the older ones) and re-solve."""
        if batch_size < 1 or seconds <= 0:
            return
        if self._calibrating is not None:
            self._calibrating.append((batch_size, k, seconds, num_drafted))
            if len(self._calibrating) >= self._calibration_steps:
                self._calibrate()
            return
        drafted = float(batch_size * k if num_drafted is None else num_drafted)
        profiled = self._unit * self._profiled(batch_size, k, drafted)
        # the step's features / seconds: relative errors, as the profile's fit
        x = (profiled / seconds, 1.0 / seconds, float(batch_size) / seconds, float(k) / seconds,
             drafted / seconds)
        f = self.forgetting
        self._xtx = [f * s + xi * xj for s, (xi, xj) in zip(self._xtx, product(x, repeat=2))]
        self._xty = [f * s + xi for s, xi in zip(self._xty, x)]  # y = seconds / seconds
        scale = self._prior_scale = max(f * self._prior_scale, self._prior_floor)
        xtx = np.array([scale * p + s for p, s in zip(self._prior_xtx, self._xtx)]).reshape(5, 5)
        xty = np.array([scale * p + s for p, s in zip(self._prior_xty, self._xty)])
        self.coefficients = self._solve(xtx, xty).tolist()
        self.model = self._composed(*self.coefficients)

    def _profiled(self, batch_size: int, k: int, num_drafted: float | None) -> float:
        """The profile's time for a step, in its own units."""
        drafted = batch_size * k if num_drafted is None else num_drafted
        return (self._profile.target_time(batch_size, 1.0 + drafted / batch_size)
                + k * self._profile.draft_time(batch_size))

    def _calibrate(self) -> None:
        """Read the profile in this device's seconds (``unit``: the median ratio of the steps
        timed so far to the profile's), rescale the corrections' prior to match, and fit those steps."""
        steps, self._calibrating = self._calibrating or [], None
        ratios = [t / p for b, k, t, d in steps if (p := self._profiled(b, k, d)) > 0]
        if ratios:
            self._unit = float(np.median(ratios))
            xtx = np.array(self._prior_xtx).reshape(5, 5)
            xtx[1:, 1:] /= self._unit ** 2  # the corrections' rows: features over times now in seconds
            self._prior_xtx = xtx.ravel().tolist()  # (the prior's xty is the scale's alone: unchanged)
        for step in steps:
            self._refit(*step)

    def _composed(self, s: float, c0: float, c1: float, d0: float, e: float) -> LatencyModel:
        """The profile's model read ``s`` times slower, plus the correction. The cost ``e`` of a
        draft token verified goes to the verifying pass's per-token cost (``c2 b n`` with ``n = 1 +``
        drafts per request), less ``e b`` per request, so that a plain step does not pay it."""
        s = max(s, 0.0) * self._unit
        (p0, p1, p2), (q0, q1) = self._profile.target_coef, self._profile.draft_coef
        target = [s * p0 + c0, s * p1 + c1 - e, s * p2 + e]
        return LatencyModel(target, [s * q0 + d0, s * q1], self.grid, grid_scale=s)

    @staticmethod
    def _solve(xtx: np.ndarray, xty: np.ndarray) -> np.ndarray:
        return np.linalg.solve(xtx, xty)


def _step_features(b: int, k: int) -> np.ndarray:
    """Whole-step features of the prior's pseudo-steps: [1, b, k, D], full drafts (D = k b)."""
    return np.array([1.0, b, k, k * b], dtype=np.float64)
