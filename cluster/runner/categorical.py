"""Drawing one token per row from a categorical distribution: by the inverse of its CDF, or by an exponential race.

The inverse CDF costs one uniform number and one running sum over the vocabulary per row; it
is how every unseeded row and every seeded row of an n-gram (or no) speculation engine draws.
The exponential race (``argmax(probs / Exponential(1))``) needs a vocab-sized noise tensor per
row: on a 2-core CPU about 0.2 ms per row of 49,152 with ``uniform_`` and a log (1 ms with
``exponential_``), against 0.03 ms for the running sum and search. It is kept for seeded rows
of a draft-model engine, where draft and target race with the same noise (coupled
verification). Both are exact draws; the inverse CDF's probabilities are those of the float32
running sum (each token's mass exact up to the rounding of one float32 addition).
"""

from __future__ import annotations

import torch


def sample_categorical(
    probs: torch.Tensor,  # [num_rows, vocab_size] float32, non-negative, unnormalized is fine
    uniforms: torch.Tensor,  # [num_rows] float32 in [0, 1): each row's own number
) -> torch.Tensor:  # [num_rows] int64
    """Token ``i`` of a row with probability ``probs[i] / probs.sum()`` when its uniform is
    uniform: the first token whose running sum exceeds ``u * total``. A token of probability 0
    is never drawn. The same row and number always give the same token, which is what lets a
    draft and its verifier share a position's number (``cluster.runner.rejection``)."""
    cdf = probs.cumsum(dim=-1)  # [num_rows, vocab_size]
    total = cdf[:, -1:]  # [num_rows, 1]
    # u * total may round up to total; keep it below, so the search lands on a token of mass > 0
    # (the first index whose running sum exceeds u; a zero-mass token never raises the sum).
    targets = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def sample_race(
    probs: torch.Tensor,  # [num_rows, vocab_size] float32, non-negative, unnormalized is fine
    exponentials: torch.Tensor,  # [num_rows, vocab_size] float32, independent Exponential(1) numbers
) -> torch.Tensor:  # [num_rows] int64
    """The exponential race (Gumbel-max): the token with the largest ``probs / exponentials`` wins,
    token ``i`` with probability ``probs[i] / probs.sum()``. Two distributions racing with the
    same noise pick the same token with probability at least ``(1 - tv) / (1 + tv)`` (``tv``
    their total variation distance), which is what coupled verification of a draft model uses."""
    return (probs / exponentials).argmax(dim=-1)
