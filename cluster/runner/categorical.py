"""Drawing one token per row from a categorical distribution, by the inverse of its CDF.

Each random row costs one uniform number and one running sum over the vocabulary. The
exponential race this replaces (``argmax(probs / Exponential(1))``) drew a vocab-sized
noise tensor per row: on a 2-core CPU ``exponential_`` costs about 1 ms per row of 49,152
(31 ms for a batch of 32, as long as the model's forward pass), the running sum and search
about 0.03 ms. Both are exact draws; here the probabilities are those of the float32 running
sum (each token's mass exact up to the rounding of one float32 addition).
"""

from __future__ import annotations

import torch


def sample_categorical(
    probs: torch.Tensor,  # [num_rows, vocab_size] float32, non-negative, unnormalized is fine
    generators: dict[int, torch.Generator],  # row -> its own generator (seeded requests)
    batched: bool,  # some row without a generator draws from the device's default generator
) -> torch.Tensor:  # [num_rows] int64
    """Token ``i`` of a row with probability ``probs[i] / probs.sum()``; a token of probability 0
    is never drawn. Rows without a generator share one batched draw (when ``batched``); a row
    with a generator draws exactly one number from it."""
    num_rows = probs.shape[0]
    cdf = probs.cumsum(dim=-1)  # [num_rows, vocab_size]
    total = cdf[:, -1:]  # [num_rows, 1]
    if batched:
        uniforms = torch.rand(num_rows, 1, device=probs.device)
    else:
        uniforms = torch.zeros(num_rows, 1, device=probs.device)
    for row, generator in generators.items():
        uniforms[row].uniform_(generator=generator)
    # u * total may round up to total; keep it below, so the search lands on a token of mass > 0
    # (the first index whose running sum exceeds u; a zero-mass token never raises the sum).
    targets = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)
