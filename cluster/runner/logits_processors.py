"""Logits processors: the tensor steps between a model's logits and the distribution a request samples from.

Contract shared by every function here:

- Out of place. A processor returns a new tensor and never writes into its input, so the
  speculative rejection sampler can run the same logits through them more than once.
- Vectorized over rows with per-row settings; no Python loop over rows or over the vocabulary.
- Device-agnostic: every tensor is created on the device of the logits (or of the metadata,
  which the runner builds on the same device).
- Logits are float32 ``[num_reqs, vocab_size]``; a masked-out token is ``-inf``.
"""

from __future__ import annotations

import torch

from cluster.runner.host_copy import to_device
from cluster.runner.sampling_metadata import SamplingMetadata


def apply_penalties(
    logits: torch.Tensor,  # [num_reqs, vocab_size] float32
    metadata: SamplingMetadata,
) -> torch.Tensor:  # [num_reqs, vocab_size] float32
    """Repetition penalty on prompt + output tokens, then presence/frequency on output tokens.

    Repetition follows vLLM and HF ``RepetitionPenaltyLogitsProcessor``: a seen token's logit is
    divided by the penalty when positive and multiplied by it otherwise, once per token however
    often it occurs. Presence and frequency follow the OpenAI API:
    ``logit - presence * (count > 0) - frequency * count`` over output tokens only.
    """
    state = metadata.penalties
    if state is None:
        return logits
    counts = state.output_counts.to(logits.dtype)
    seen = state.prompt_mask | (state.output_counts > 0)
    repetition = torch.where(seen, state.repetition[:, None], 1.0)
    logits = torch.where(logits > 0, logits / repetition, logits * repetition)
    return logits - state.frequency[:, None] * counts - state.presence[:, None] * (counts > 0)


def apply_allowed_token_ids(
    logits: torch.Tensor,  # [num_reqs, vocab_size] float32
    metadata: SamplingMetadata,
) -> torch.Tensor:  # [num_reqs, vocab_size] float32
    """Set every token outside a row's ``allowed_token_ids`` to ``-inf`` (rows without keep all)."""
    if metadata.allowed_token_ids is None:
        return logits
    rows, allowed = metadata.allowed_token_ids
    restricted = logits.index_select(0, rows).masked_fill(~allowed, float("-inf"))
    return logits.index_put((rows,), restricted)


def apply_logit_bias(
    logits: torch.Tensor,  # [num_reqs, vocab_size] float32
    metadata: SamplingMetadata,
) -> torch.Tensor:  # [num_reqs, vocab_size] float32
    """Add each row's ``logit_bias`` to the logits of its token ids."""
    if metadata.logit_bias is None:
        return logits
    rows, token_ids, values = metadata.logit_bias
    return logits.index_put((rows, token_ids), values, accumulate=True)


def apply_banned_token_ids(
    logits: torch.Tensor,  # [num_reqs, vocab_size] float32
    metadata: SamplingMetadata,
) -> torch.Tensor:  # [num_reqs, vocab_size] float32
    """Set each row's banned token ids (e.g. EOS and stop ids before ``min_tokens``) to ``-inf``."""
    if not metadata.banned_token_ids:
        return logits
    rows = [row for row, ids in metadata.banned_token_ids.items() for _ in ids]
    cols = [token for ids in metadata.banned_token_ids.values() for token in ids]
    index = to_device([rows, cols], torch.long, logits.device)
    return logits.index_put((index[0], index[1]), logits.new_full((), float("-inf")))


def apply_temperature(
    logits: torch.Tensor,  # [num_reqs, vocab_size] float32
    metadata: SamplingMetadata,
) -> torch.Tensor:  # [num_reqs, vocab_size] float32
    """Divide each row by its temperature; greedy rows (temperature 0) are divided by 1. When
    every random row's temperature is 1 the logits come back as they are (x / 1 is x)."""
    if metadata.unit_temperature:
        return logits
    temperature = metadata.temperature
    if not metadata.all_random:
        temperature = torch.where(temperature == 0, 1.0, temperature)
    return logits / temperature[:, None]


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,  # [num_reqs, vocab_size] float32, after temperature
    metadata: SamplingMetadata,
) -> torch.Tensor:  # [num_reqs, vocab_size] float32
    """Mask every token outside its row's top-k, top-p and min-p sets to ``-inf``; one sort per row.

    Applied in the order top-k, top-p, min-p (as SGLang):

    - top-k keeps the tokens whose logit is >= the k-th largest, so ties with the k-th token
      survive (as HF and vLLM); ``top_k == 0`` keeps everything.
    - top-p, on the top-k distribution renormalized, keeps the smallest set of most likely
      tokens whose mass is >= ``top_p``: a token is dropped when it and every less likely token
      together hold at most ``1 - top_p``. The most likely token is always kept; ties at the
      boundary are broken by sort order.
    - min-p drops tokens with probability < ``min_p * max_prob``. It is a ratio test, so it gives
      the same set before or after renormalization.
    """
    vocab_size = logits.shape[-1]
    sorted_logits, sorted_ids = logits.sort(dim=-1)  # ascending: the most likely token is last
    top_k = metadata.top_k
    top_k = torch.where((top_k <= 0) | (top_k > vocab_size), vocab_size, top_k)
    kth_largest = sorted_logits.gather(1, (vocab_size - top_k)[:, None])  # [num_reqs, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))

    sorted_probs = sorted_logits.softmax(dim=-1)
    tail_mass = sorted_probs.cumsum(dim=-1)  # mass of this token and every less likely one
    drop = tail_mass <= (1.0 - metadata.top_p)[:, None]
    drop |= sorted_probs < (metadata.min_p * sorted_probs[:, -1])[:, None]
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)
