"""The latency model that picks the speculation length (arXiv 2310.18813, section 4).

Expected time per output token of a batch of ``b`` decoding requests at length ``k``::

    TPOT(b, k) = (k * T_draft(b) + T_target(b, k + 1)) / E(k)

    E(k) = 1 + a_1 + a_1 a_2 + ... + a_1 a_2 ... a_k

where ``a_j`` is the probability that draft position ``j`` is accepted given that the
positions before it were (with one rate ``a`` for all positions, E(k) = (1 - a^(k+1)) /
(1 - a)). ``E(k)`` counts the tokens a request gains per step: accepted drafts plus the
recovered or bonus token. ``k = 0`` is plain decoding: ``TPOT = T_target(b, 1)``.

Step times are linear in what the hardware does per step:

    T_target(b, n) = c0 + c1 * b + c2 * b * n     (n = tokens per request = k + 1)
    T_draft(b)     = d0 + d1 * b                  (one draft pass)

``c0`` and ``d0`` are the fixed costs of a pass (launches, Python, reading the weights
once while the batch is small), ``c1`` per-request costs (attention over the context,
sampling), ``c2`` the per-token compute. Assumptions: acceptance does not depend on the
batch size; contexts are about as long as when profiled (attention cost sits in c1);
the batch does not change within a step. Measured step times are not quite linear (on a
CPU the cost of a token falls as a pass carries more of them), so the coefficients are
fitted to relative errors (:func:`fit_linear`): the model is about as far off, in per
cent, at batch 1 as at batch 32. The benchmark reports how far the predictions fall from
measurements.

Proposers that may propose fewer tokens than asked (n-gram lookup finds no match, or its
match ends early) are described by a *coverage* ``c_j``: the share of requests asked for
position ``j`` that get a token there. The verifying pass then carries
``n = 1 + c_1 + ... + c_k`` tokens per request on average, and ``a_j`` is read as the
*effective* acceptance (a position asked for but not proposed counts as rejected), so that
E(k) stays the tokens a request gains per step. A draft model always proposes all ``k``:
coverage 1 (``None``), where both readings of ``a_j`` agree.

Where a profile measured the passes (:class:`~cluster.spec_decode.pass_grid.PassGrid`), a model can
stand on the measured times instead of the line: ``T_target(b, n) = s grid(b, n) + c0 + c1 b +
c2 b n`` and ``T_draft(b) = s grid(b) + d0 + d1 b``, the coefficients then being a correction
to the grid (0 as profiled) and ``s`` (``grid_scale``, 1 as profiled) how much slower or
faster this device runs than the one profiled: ``AdaptiveController`` learns both online.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cluster.spec_decode.pass_grid import PassGrid, read_row


def target_features(batch_size: float, tokens_per_request: float) -> list[float]:
    return [1.0, batch_size, batch_size * tokens_per_request]


def draft_features(batch_size: float) -> list[float]:
    return [1.0, batch_size]


def fit_linear(features: list[list[float]], seconds: list[float]) -> list[float]:
    """Non-negative coefficients minimising the *relative* squared error, sum ((pred - t) / t)^2.

    Relative, because the controllers compare step times of one batch size against each
    other (what matters is each one's ratio, not its milliseconds), and because measured
    step times are not linear over a wide grid: an unweighted fit lets the slowest cells
    (largest batch, most tokens) set the coefficients and misses the small ones by 30%.
    Non-negative, because a negative cost is noise: a coefficient the unconstrained fit
    makes negative is fixed at 0 and the others re-fitted without it (clipping it after
    the fit would leave them fitted to a term that is gone)."""
    x = np.asarray(features, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if x.ndim != 2 or len(x) != len(t) or not len(t):
        raise ValueError(f"fit_linear needs one feature row per time, got {x.shape} rows for {len(t)} times")
    if np.any(t < 0):
        raise ValueError("step times cannot be negative")
    scale = 1.0 / np.maximum(t, 1e-12)  # a time below the clock's resolution weighs like 1 ps
    weighted_x, weighted_t = x * scale[:, None], t * scale
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(weighted_x[:, active], weighted_t, rcond=None)
        if np.all(solution >= 0):
            coef[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    return [float(c) for c in coef]


def expected_tokens(acceptance: list[float], k: int) -> float:
    """E(k): tokens emitted per verifying step; positions beyond the list reuse its last rate."""
    total, survive = 1.0, 1.0
    for j in range(k):
        rate = acceptance[min(j, len(acceptance) - 1)] if acceptance else 0.0
        survive *= min(max(rate, 0.0), 1.0)
        total += survive
    return total


def expected_drafted(coverage: list[float] | None, k: int) -> float:
    """Draft tokens a request carries into the verifying pass at length ``k``: the sum of the
    first ``k`` coverages (positions beyond the list reuse its last value; None: all ``k``)."""
    if coverage is None:
        return float(k)
    if not coverage:
        return 0.0
    return float(sum(min(max(coverage[min(j, len(coverage) - 1)], 0.0), 1.0) for j in range(k)))


@dataclass
class LatencyModel:
    target_coef: list[float]  # c0, c1, c2
    draft_coef: list[float]  # d0, d1
    grid: PassGrid | None = None  # measured pass times the coefficients correct (None: the line alone)
    grid_scale: float = 1.0  # the grid's times are read times this

    # Sums of floats rather than np.dot: the controllers call these every step.
    def target_time(self, batch_size: int, tokens_per_request: float) -> float:
        c0, c1, c2 = self.target_coef
        grid = self.grid
        measured = self.grid_scale * grid.verify_time(batch_size, tokens_per_request) if grid is not None else 0.0
        return float(measured + c0 + c1 * batch_size + c2 * (batch_size * tokens_per_request))

    def draft_time(self, batch_size: int) -> float:
        """One draft pass, never below 0: a learnt correction (d0, d1) fitted where the batch sat
        at a few sizes can extrapolate below nothing at others (held near batch 9, a negative d1
        made k = 6 look 2.3x cheaper per token than plain decoding at batch 16)."""
        d0, d1 = self.draft_coef
        measured = self.grid_scale * self.grid.draft_time(batch_size) if self.grid is not None else 0.0
        return max(float(measured + d0 + d1 * batch_size), 0.0)

    def step_time(self, batch_size: int, k: int, coverage: list[float] | None = None) -> float:
        """k draft passes and a verifying pass of 1 + expected_drafted(coverage, k) tokens per
        request (never below 0: a learnt correction to a grid may be negative)."""
        return max(k * self.draft_time(batch_size) + self.target_time(batch_size, 1 + expected_drafted(coverage, k)),
                   0.0)

    def time_per_token(self, batch_size: int, k: int, acceptance: list[float],
                       coverage: list[float] | None = None) -> float:
        return self.step_time(batch_size, k, coverage) / expected_tokens(acceptance, k)

    def time_per_token_by_k(self, batch_size: int, acceptance: list[float], max_k: int,
                            coverage: list[float] | None = None) -> list[float]:
        """``time_per_token`` for k = 0..max_k in one loop of floats: the controllers ask for it
        every step (``AdaptiveController.choose_k`` took ~75 us with numpy per k, ~11 us so)."""
        c0, c1, c2 = (float(c) for c in self.target_coef)
        row = self.grid.verify_row(batch_size) if self.grid is not None else None
        fixed = c0 + c1 * batch_size  # the verifying pass's cost whatever its tokens
        per_pass = self.draft_time(batch_size)  # one more draft pass
        per_token = c2 * batch_size  # one more draft token verified per request
        scale = self.grid_scale
        costs = [max(fixed + per_token + (scale * row[0] if row is not None else 0.0), 0.0)]
        tokens, survive, drafted = 1.0, 1.0, 0.0
        for k in range(1, max_k + 1):
            rate = acceptance[min(k - 1, len(acceptance) - 1)] if acceptance else 0.0
            survive *= min(max(rate, 0.0), 1.0)
            tokens += survive
            if coverage is None:
                drafted += 1.0
            elif coverage:  # as expected_drafted: positions beyond the list reuse its last value
                drafted += min(max(coverage[min(k - 1, len(coverage) - 1)], 0.0), 1.0)
            step = fixed + k * per_pass + (1.0 + drafted) * per_token
            if row is not None:
                step += scale * read_row(row, 1.0 + drafted)
            costs.append(max(step, 0.0) / tokens)
        return costs

    def best_k(self, batch_size: int, acceptance: list[float], max_k: int,
               coverage: list[float] | None = None) -> int:
        """The k of least time per token (the smallest such k on a tie)."""
        costs = self.time_per_token_by_k(batch_size, acceptance, max_k, coverage)
        return costs.index(min(costs))

    @classmethod
    def fit(
        cls,
        target_samples: list[tuple[int, int, float]],  # (batch size, tokens per request, seconds)
        draft_samples: list[tuple[int, float]],  # (batch size, seconds)
    ) -> "LatencyModel":
        target = fit_linear([target_features(b, n) for b, n, _ in target_samples], [t for *_, t in target_samples])
        draft = fit_linear([draft_features(b) for b, _ in draft_samples], [t for _, t in draft_samples]) \
            if draft_samples else [0.0, 0.0]
        return cls(target, draft)


def fit_steps(samples: list[tuple[int, int, float]]) -> LatencyModel:
    """A model fitted to whole speculative steps ``(b, k, seconds)`` (drafting + verifying,
    as vLLM times them). ``step(b, k) = c0 + c1 b + c2 b (k + 1) + k (d0 + d1 b)``: since
    ``b (k + 1) = b + b k``, whole steps cannot tell ``c2`` from ``c1`` and ``d1``, so the fit
    sets ``c2 = 0`` and puts every cost that grows with k in ``d0, d1``. Step times, TPOT and
    the best k are the same for every split; only ``target_time`` and ``draft_time`` taken
    apart lose their meaning."""
    features = [[1.0, b, k, k * b] for b, k, _ in samples]
    c0, c1, d0, d1 = fit_linear(features, [t for *_, t in samples])
    return LatencyModel([c0, c1, 0.0], [d0, d1])


def power_of_two_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, ... below ``max_batch``, then ``max_batch``: the batch sizes a profile covers."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]
