"""Goodness-of-fit helpers shared by the statistical tests."""

from __future__ import annotations

import math

import numpy as np
import torch


def chi2_quantile(q: float, df: int) -> float:
    """Quantile of the chi-square distribution by bisection on its CDF, P(df/2, x/2)."""
    lo, hi = 0.0, df + 20.0 * math.sqrt(df) + 50.0
    shape = torch.tensor(df / 2, dtype=torch.float64)
    for _ in range(200):
        mid = (lo + hi) / 2
        cdf = torch.special.gammainc(shape, torch.tensor(mid / 2, dtype=torch.float64)).item()
        lo, hi = (mid, hi) if cdf < q else (lo, mid)
    return (lo + hi) / 2


def chi2_statistic(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom, pooling cells expected below
    ``min_expected`` into one. Counts in cells of probability 0 make it infinite."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    if counts[probs == 0].sum() > 0:
        return math.inf, 1
    expected = probs * counts.sum()
    big = expected >= min_expected
    obs = list(counts[big]) + ([counts[~big & (probs > 0)].sum()] if (~big & (probs > 0)).any() else [])
    exp = list(expected[big]) + ([expected[~big & (probs > 0)].sum()] if (~big & (probs > 0)).any() else [])
    obs, exp = np.array(obs), np.array(exp)
    return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1
