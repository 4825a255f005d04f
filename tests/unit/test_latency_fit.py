"""The latency model's fit: relative errors, non-negative coefficients, bad input refused."""

from __future__ import annotations

import numpy as np
import pytest

from cluster.spec_decode.latency_model import LatencyModel, expected_tokens, fit_linear, target_features

GRID = [(b, n) for b in (1, 2, 4, 8, 16, 32) for n in range(1, 10)]
ACCEPTANCE = [0.35, 0.6, 0.7, 0.8, 0.9, 0.9, 0.9, 0.9]


def _made_up_step_cost(b: int, n: int) -> float:
    """A made-up cost function (no clock is read): a pass whose token cost falls as it carries
    more tokens, shaped like this machine's CPU (0.66 per token up to 32 tokens, 0.42 beyond,
    8 of fixed cost, in ms)."""
    tokens = b * n
    return 8.0 + 0.1 * b + 0.66 * min(tokens, 32) + 0.42 * max(tokens - 32, 0)


def _relative_errors(coef: list[float]) -> dict[tuple[int, int], float]:
    return {(b, n): abs(float(np.dot(coef, target_features(b, n))) / _made_up_step_cost(b, n) - 1) for b, n in GRID}


def test_relative_fit_keeps_small_batches_as_accurate_as_large_ones():
    features = [target_features(b, n) for b, n in GRID]
    times = [_made_up_step_cost(b, n) for b, n in GRID]
    relative = _relative_errors(fit_linear(features, times))
    plain = _relative_errors(np.linalg.lstsq(np.array(features), np.array(times), rcond=None)[0].tolist())
    small = [cell for cell in GRID if cell[0] * cell[1] <= 8]
    assert max(relative[c] for c in small) < 0.5 * max(plain[c] for c in small)
    assert np.mean(list(relative.values())) < np.mean(list(plain.values()))


def test_relative_fit_picks_ks_close_to_the_best_of_the_true_step_times():
    truth = {(b, n): _made_up_step_cost(b, n) for b, n in GRID}
    relative = LatencyModel.fit([(b, n, t) for (b, n), t in truth.items()], [])
    coef = np.linalg.lstsq(np.array([target_features(b, n) for b, n in GRID]), np.array(list(truth.values())),
                           rcond=None)[0]
    plain = LatencyModel(coef.tolist(), [0.0, 0.0])
    regrets = {"relative": [], "plain": []}
    for b in (1, 2, 4, 8, 16, 32):
        true_tpot = [truth[(b, k + 1)] / expected_tokens(ACCEPTANCE, k) for k in range(9)]
        for name, model in (("relative", relative), ("plain", plain)):
            regrets[name].append(true_tpot[model.best_k(b, ACCEPTANCE, 8)] / min(true_tpot) - 1)
    # The TPOT curve is flat near its minimum, so the pick itself may differ by a k or two.
    assert max(regrets["relative"]) < 0.04
    assert all(r <= p for r, p in zip(regrets["relative"], regrets["plain"]))
    assert sum(regrets["relative"]) < 0.5 * sum(regrets["plain"])


def test_a_coefficient_the_data_makes_negative_is_zero_and_the_rest_refitted():
    # Costs fall with the batch size at a fixed token count: no per-request cost to find.
    rows = [(b, n, 5.0 + 0.5 * b * n - 0.2 * b) for b in (1, 2, 4, 8) for n in (1, 2, 4)]
    features = [target_features(b, n) for b, n, _ in rows]
    times = [t for *_, t in rows]
    c0, c1, c2 = fit_linear(features, times)
    assert c1 == 0.0 and c0 > 0 and c2 > 0
    unconstrained = np.linalg.lstsq(np.array(features) / np.array(times)[:, None], np.ones(len(times)),
                                    rcond=None)[0]
    assert unconstrained[1] < 0  # the case this test is about

    def relative_sq_error(coef) -> float:
        return sum((np.dot(coef, x) / t - 1) ** 2 for x, t in zip(features, times))

    assert relative_sq_error([c0, c1, c2]) < relative_sq_error(np.clip(unconstrained, 0, None))


def test_fit_refuses_negative_times_and_mismatched_rows():
    with pytest.raises(ValueError, match="negative"):
        fit_linear([[1.0, 1.0], [1.0, 2.0]], [0.01, -0.02])
    with pytest.raises(ValueError, match="one feature row per time"):
        fit_linear([[1.0, 1.0], [1.0, 2.0]], [0.01])
