"""Token bitmasks on the logits: tensors in, tensors out, on the logits' device."""

from __future__ import annotations

import torch


def allowed_tokens(
    bitmask: torch.Tensor,  # [num_rows, words] int32: bit t % 32 of word t // 32 set = token t allowed
    vocab_size: int,
) -> torch.Tensor:  # [num_rows, vocab_size] bool
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab_size]


def apply_token_bitmask(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32
    bitmask: torch.Tensor,  # [num_rows, words] int32, on the logits' device
) -> torch.Tensor:  # [num_rows, vocab_size] float32, forbidden tokens at -inf
    """Out of place. A row of all ones (-1 words) passes through unchanged."""
    return logits.masked_fill(~allowed_tokens(bitmask, logits.shape[-1]), float("-inf"))
