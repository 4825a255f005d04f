import numpy as np
import pytest

from tests.goodness_of_fit import chi2_quantile, chi2_statistic


def test_chi2_quantile_matches_table():
    table_999 = {1: 10.828, 2: 13.816, 3: 16.266, 5: 20.515, 7: 24.322}
    for df, value in table_999.items():
        assert chi2_quantile(0.999, df) == pytest.approx(value, abs=2e-3)


def test_chi2_statistic_pools_small_cells_and_rejects_impossible_ones():
    probs = np.array([0.5, 0.3, 0.19, 0.01, 0.0])
    statistic, df = chi2_statistic(np.array([50, 30, 19, 1, 0]), probs)
    assert statistic == pytest.approx(0.0) and df == 3  # 100 * 0.01 = 1 < 5: pooled with nothing else
    assert chi2_statistic(np.array([50, 30, 19, 0, 1]), probs)[0] == float("inf")
