"""Exact speculative sampling (Leviathan et al. 2023; Chen et al. 2023): drafts in, verified tokens out.

Request i drafted ``k_i`` tokens ``x_0 .. x_{k_i-1}``; ``x_j`` was sampled from ``draft_probs[j]``
and the target scored all ``k_i + 1`` positions in one pass, giving ``target_probs[j]`` (the
target's distribution after the prefix ending in ``x_{j-1}``). For ``j = 0, 1, ...``:

* accept ``x_j`` with probability ``min(1, target_probs[j][x_j] / draft_probs[j][x_j])``;
* at the first rejection, emit a *recovered* token sampled from
  ``normalize(max(0, target_probs[j] - draft_probs[j]))`` and stop;
* if all ``k_i`` drafts are accepted, emit a *bonus* token sampled from ``target_probs[k_i]``.

A step therefore yields between 1 and ``k_i + 1`` tokens, and ``k_i = 0`` is plain sampling.

Why the output follows the target exactly. Fix one position, write ``t = target_probs[j]`` and
``d = draft_probs[j]``. Token ``y`` is proposed with probability ``d(y)`` and kept with
probability ``min(1, t(y) / d(y))``, so it is emitted by acceptance with probability
``min(d(y), t(y))``. A rejection happens with probability
``1 - sum(min(d, t)) = sum(max(0, t - d)) = Z``, and then ``y`` is emitted with probability
``max(0, t(y) - d(y)) / Z``. In total ``min(d(y), t(y)) + max(0, t(y) - d(y)) = t(y)``. After an
acceptance the next position starts from a prefix that was itself drawn from the target, so by
induction every emitted token follows the target's distribution given the tokens before it,
whatever the draft. A token with ``t(y) = 0`` is never emitted (never accepted, zero residual).
Deterministic drafts (n-gram lookup, a greedy draft model) are the case ``d = one_hot(x)``:
accept with probability ``t(x)``, else emit from ``t`` with ``x`` removed and renormalized.
``Z = 0`` (``t == d``) means a rejection has probability 0; ``recovered_probs`` then falls back
to ``t`` so that float rounding can never produce NaN.

Greedy rows (temperature 0, one-hot ``target_probs``) take a fast path without random numbers:
accept while ``x_j == argmax(target_probs[j])``, then emit that argmax.

Coupled verification (seeded rows, when the caller asks for it). Rejection sampling's
realization depends on ``k``: the same seed walks a different path when a controller drafts
more or fewer tokens. A coupled row instead draws the target's own token ``y_j`` at every
verified position by the inverse of its CDF with that position's number (the same number
plain sampling would use there, ``random_stream.Lane.SAMPLE``), accepts drafts while
``x_j == y_j`` and emits ``y_j`` at the first mismatch (or ``y_k`` as bonus). Every emitted
token is ``y_j``, a draw from ``target_probs[j]`` with a number no earlier position used, so
the output follows the target exactly, and the text is the one decoding without speculation
gives. For point-mass drafts the acceptance probability is ``t(x_j)``, as in rejection
sampling. A draft model's drafts must have been drawn with the same numbers (lane SAMPLE) by
the same method. By the inverse CDF, ``x_j == y_j`` only where the two CDFs put the one
number in the same token: any difference in mass ahead of a token in vocabulary order shifts
its interval, so two nearly equal distributions with a long tail rarely agree there (an int8
self-draft that rejection sampling accepts 95% of the time: 59%). So an engine with a draft
model draws seeded tokens by an exponential race on per-position noise (``race``, Gumbel-max):
the same token with probability at least ``(1 - tv) / (1 + tv)``, still at most rejection
sampling's ``sum(min(d, t)) = 1 - tv``; ``tandem bench spec --verification both`` measures it.

Randomness mirrors ``cluster.runner.sampler``: unseeded random rows share one batched draw of
uniforms ``[num_reqs, max_k]`` and one batched draw of the final token; a seeded row's numbers
are keyed by its seed and output position (``random_stream.py``): the acceptance test at
position ``p`` uses lane ACCEPT, the token emitted at ``p`` lane SAMPLE (its uniform, or its
noise when ``race``). So its tokens depend
on its seed and its own inputs, never on its place in the batch or on the other rows. Greedy
rows use no numbers, and an all-greedy batch draws nothing at all.

``rejection_sample`` takes the distributions packed request after request (``[sum (k_i + 1),
vocab_size]``, as the verifying pass returns them). A batch of only greedy rows needs no
distributions at all: ``greedy_verify`` walks the drafts on the host against the target's
argmax, which is what the greedy fast path computes. The tests hold both against a plain
one-request reference (``tests/speculative_reference.py``).

Host syncs: one ``.tolist()`` of the result (``verify_drafts`` leaves it to a caller that reads
more with it: the emitted tokens' logprobs). The greedy mask comes from the host (it decides
which draws to make) and every index goes to the device without a wait
(:mod:`cluster.runner.host_copy`); the one other read is of seeded rows verified by rejection
with race noise (``race`` without ``coupled``), whose final draw's key needs its position.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from cluster.runner.categorical import sample_categorical
from cluster.runner.host_copy import to_device
from cluster.runner.random_stream import Lane, SeedKey, draw_seeded, row_uniforms

__all__ = ["RejectionOutput", "VerifiedOnDevice", "greedy_verify", "read_verified", "recovered_probs", "rejection_sample",
           "verify_drafts", "verify_on_device"]


class RejectionOutput(NamedTuple):
    # per request: the accepted draft tokens, then one recovered or bonus token (num_accepted + 1)
    output_token_ids: list[list[int]]
    num_accepted: list[int]  # per request: accepted draft tokens, 0..num_draft_tokens[i]


def recovered_probs(
    target_probs: torch.Tensor,  # [num_reqs, vocab_size] float32
    draft_probs: torch.Tensor,  # [num_reqs, vocab_size] float32
) -> torch.Tensor:  # [num_reqs, vocab_size] float32
    """``normalize(max(0, target_probs - draft_probs))`` per row; ``target_probs`` where that is all 0."""
    residual = (target_probs - draft_probs).clamp_(min=0)
    total = residual.sum(dim=-1, keepdim=True)  # [num_reqs, 1]
    normalized = residual / total.clamp(min=torch.finfo(residual.dtype).tiny)
    return torch.where(total > 0, normalized, target_probs)


class VerifiedOnDevice(NamedTuple):
    """``rejection_sample``'s result before its read (device tensors)."""

    output: torch.Tensor  # [num_reqs, max_k + 1] int64: accepted drafts, then the final token, then padding
    num_accepted: torch.Tensor  # [num_reqs] int64

    def packed(self) -> torch.Tensor:  # [num_reqs, max_k + 2] int64: the output row, then num_accepted
        """What one read brings back; ``read_verified`` turns its host copy into a ``RejectionOutput``."""
        return torch.cat([self.output, self.num_accepted[:, None]], dim=1)


def rejection_sample(
    draft_token_ids: list[list[int]],  # per request, its k_i draft tokens
    draft_probs: torch.Tensor | None,  # [sum k_i, vocab_size] float32, request after request; None = one-hot
    target_probs: torch.Tensor,  # [sum (k_i + 1), vocab_size] float32, request after request
    greedy: torch.Tensor,  # [num_reqs] bool, on the host
    seeded: dict[int, SeedKey],  # row -> (seed, output position of its first verified token)
    coupled: bool = False,  # seeded rows are verified by coupling (module docstring)
    race: bool = False,  # seeded rows draw tokens by an exponential race on keyed noise, not the inverse CDF
) -> RejectionOutput:
    """Verify each request's drafts (see the module docstring for the rule and why it is exact):
    ``verify_drafts``, then the one read of its result."""
    verified = verify_drafts(draft_token_ids, draft_probs, target_probs, greedy, seeded, coupled, race)
    return read_verified(verified.packed().tolist())  # the one read of the result


def read_verified(host_rows: list[list[int]]) -> RejectionOutput:
    """``RejectionOutput`` from the host copy of ``VerifiedOnDevice.packed()``."""
    return RejectionOutput(
        output_token_ids=[row[: row[-1] + 1] for row in host_rows],
        num_accepted=[row[-1] for row in host_rows],
    )


def verify_drafts(
    draft_token_ids: list[list[int]],  # per request, its k_i draft tokens
    draft_probs: torch.Tensor | None,  # [sum k_i, vocab_size] float32, request after request; None = one-hot
    target_probs: torch.Tensor,  # [sum (k_i + 1), vocab_size] float32, request after request
    greedy: torch.Tensor,  # [num_reqs] bool, on the host
    seeded: dict[int, SeedKey],  # row -> (seed, output position of its first verified token)
    coupled: bool = False,
    race: bool = False,
) -> VerifiedOnDevice:
    """``rejection_sample`` without reading its result back: the caller may compute more from
    the emitted tokens on the device (their logprobs) and read it all at once.

    The distributions come packed request after request, as the target's verifying pass
    returns them, and are read through an index: padding every request to the longest one's
    ``k + 1`` rows of the vocabulary cost more than the forward pass with ragged n-gram drafts
    at batch 32. They are not normalized here: the final draw (``sample_categorical``) is
    scale-free."""
    counts = [len(d) for d in draft_token_ids]
    num_reqs, max_k = len(counts), max(counts, default=0)
    if target_probs.dim() != 2 or target_probs.shape[0] != sum(counts) + num_reqs:
        raise ValueError(f"target_probs must be [sum (k_i + 1), vocab_size] = [{sum(counts) + num_reqs}, vocab_size], "
                         f"got {tuple(target_probs.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (sum(counts), target_probs.shape[1]):
        raise ValueError(f"draft_probs must be None or [sum k_i, vocab_size] = [{sum(counts)}, "
                         f"{target_probs.shape[1]}], got {tuple(draft_probs.shape)}")
    device = target_probs.device
    num_draft = to_device(counts, torch.int64, device)  # [num_reqs]
    draft_start = torch.cumsum(num_draft, 0) - num_draft  # [num_reqs]
    target_start = draft_start + torch.arange(num_reqs, device=device)  # each request has k_i + 1 rows
    j = torch.arange(max_k + 1, device=device)  # [max_k + 1]
    # Positions past a row's own rows point at its last one (padding: never read into the result).
    target_rows = target_start[:, None] + torch.minimum(j, num_draft[:, None])  # [num_reqs, max_k + 1]
    draft_rows = (draft_start[:, None] + torch.minimum(j[:max_k], (num_draft - 1).clamp(min=0)[:, None]))
    draft_rows = draft_rows.clamp(max=max(sum(counts) - 1, 0))  # [num_reqs, max_k]
    _check_rows(num_reqs, greedy, seeded)
    ids = to_device([d + [0] * (max_k - len(d)) for d in draft_token_ids], torch.int64, device)
    if num_reqs == 0:
        empty = torch.zeros(0, max_k + 1, dtype=torch.int64, device=device)
        return VerifiedOnDevice(empty, empty[:, 0])
    output, num_accepted = verify_on_device(ids.view(num_reqs, max_k), counts, draft_probs, draft_rows, target_probs,
                                            target_rows, greedy, seeded, coupled, race)
    return VerifiedOnDevice(output, num_accepted)


def verify_on_device(
    draft_token_ids: torch.Tensor,  # [num_reqs, max_k] int64
    num_draft_tokens: list[int],
    draft_probs: torch.Tensor | None,  # [num_draft_rows, vocab_size]
    draft_rows: torch.Tensor,  # [num_reqs, max_k] int64: the row of draft_probs at (request, position)
    target_probs: torch.Tensor,  # [num_target_rows, vocab_size]
    target_rows: torch.Tensor,  # [num_reqs, max_k + 1] int64: the row of target_probs at (request, position)
    greedy: torch.Tensor,
    seeded: dict[int, SeedKey],
    coupled: bool,
    race: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule, reading distributions through row indices (shapes already checked; at least one
    row), on the device: each row's tokens ``[num_reqs, max_k + 1]`` (accepted drafts, then the
    final token, then padding) and its accepted count ``[num_reqs]``."""
    num_reqs, max_k = draft_token_ids.shape
    device = target_probs.device
    greedy_rows = greedy.tolist()  # a host tensor: no wait
    greedy = to_device(greedy, torch.bool, device)
    seeded = {row: key for row, key in seeded.items() if not greedy_rows[row]}
    coupled_rows = sorted(seeded) if coupled else []
    standard = {row: key for row, key in seeded.items() if not coupled}  # seeded rows verified by rejection
    num_random = num_reqs - sum(greedy_rows)
    any_unseeded_random = len(seeded) < num_random
    any_standard = num_random > len(coupled_rows)

    num_draft = to_device(num_draft_tokens, torch.int64, device)  # [num_reqs]
    is_draft = torch.arange(max_k, device=device) < num_draft[:, None]  # [num_reqs, max_k]
    draft_ids = torch.where(is_draft, draft_token_ids.long(), 0)  # [num_reqs, max_k] padding -> a valid id
    rows = torch.arange(num_reqs, device=device)

    # Each row kind fills ``accepted`` and ``final_ids`` (the token after the accepted run) for its rows.
    accepted = torch.zeros(num_reqs, max_k, dtype=torch.bool, device=device)
    final_ids = torch.zeros(num_reqs, dtype=torch.int64, device=device)
    if any(greedy_rows):
        target_argmax = target_probs.argmax(dim=-1)[target_rows]  # [num_reqs, max_k + 1]
        accepted = torch.where(greedy[:, None], draft_ids == target_argmax[:, :max_k], accepted)
    if coupled_rows:
        samples = _coupled_samples(coupled_rows, num_draft_tokens, target_probs, target_rows, seeded, race)
        coupled_mask = torch.zeros(num_reqs, dtype=torch.bool, device=device)
        coupled_mask[to_device(coupled_rows, torch.int64, device)] = True
        accepted = torch.where(coupled_mask[:, None], draft_ids == samples[:, :max_k], accepted)
    if any_standard:
        uniforms = row_uniforms(num_reqs, max_k, standard, Lane.ACCEPT, device, any_unseeded_random)
        # Accept iff u < target / draft, written without a division: P = min(1, target / draft).
        target_at_draft = target_probs[target_rows[:, :max_k], draft_ids]  # [num_reqs, max_k]
        if draft_probs is None:
            random_accepted = uniforms < target_at_draft
        else:
            random_accepted = uniforms * draft_probs[draft_rows, draft_ids] < target_at_draft
        standard_mask = ~greedy
        if coupled_rows:
            standard_mask &= ~coupled_mask
        accepted = torch.where(standard_mask[:, None], random_accepted, accepted)
    accepted &= is_draft
    # The first rejection (or k_i) is the length of the leading run of accepted drafts.
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [num_reqs]

    if any_standard:
        final_ids = _standard_final(draft_ids, num_draft, num_accepted, draft_probs, draft_rows, target_probs,
                                    target_rows, standard, any_unseeded_random, race)
    if coupled_rows:
        final_ids = torch.where(coupled_mask, samples[rows, num_accepted], final_ids)
    if any(greedy_rows):
        final_ids = torch.where(greedy, target_argmax[rows, num_accepted], final_ids)

    output = torch.cat([draft_ids, torch.zeros_like(final_ids)[:, None]], dim=1)  # [num_reqs, max_k + 1]
    output.scatter_(1, num_accepted[:, None], final_ids[:, None])
    return output, num_accepted


def _coupled_samples(
    coupled_rows: list[int],
    num_draft_tokens: list[int],
    target_probs: torch.Tensor,  # [num_target_rows, vocab_size]
    target_rows: torch.Tensor,  # [num_reqs, max_k + 1]
    seeded: dict[int, SeedKey],
    race: bool,
) -> torch.Tensor:  # [num_reqs, max_k + 1] int64: the target's draw at each verified position (0 elsewhere)
    """Coupled rows: the target's token at each of their ``k_i + 1`` positions, drawn with that
    position's SAMPLE numbers; only those rows' real positions are computed."""
    num_reqs, width = target_rows.shape
    device = target_rows.device
    cells = [(row, j) for row in coupled_rows for j in range(num_draft_tokens[row] + 1)]  # (row, position offset)
    keys = [SeedKey(seeded[row].seed, seeded[row].position + j) for row, j in cells]
    flat = to_device([row * width + j for row, j in cells], torch.int64, device)
    samples = torch.zeros(num_reqs * width, dtype=torch.int64, device=device)
    samples[flat] = draw_seeded(target_probs[target_rows.reshape(-1)[flat]], keys, Lane.SAMPLE, race)
    return samples.view(num_reqs, width)


def _standard_final(
    draft_ids: torch.Tensor,  # [num_reqs, max_k]
    num_draft: torch.Tensor,  # [num_reqs]
    num_accepted: torch.Tensor,  # [num_reqs]
    draft_probs: torch.Tensor | None,
    draft_rows: torch.Tensor,  # [num_reqs, max_k]
    target_probs: torch.Tensor,
    target_rows: torch.Tensor,  # [num_reqs, max_k + 1]
    standard: dict[int, SeedKey],  # seeded rows verified by rejection
    any_unseeded_random: bool,
    race: bool,
) -> torch.Tensor:  # [num_reqs] int64
    """Rejection sampling's last token: recovered after a rejection, bonus after ``k_i``
    acceptances, drawn with the SAMPLE numbers of the position it lands on."""
    num_reqs, max_k = draft_ids.shape
    rows = torch.arange(num_reqs, device=target_probs.device)
    final_probs = target_probs[target_rows[rows, num_accepted]]  # [num_reqs, vocab_size] bonus distribution
    if max_k > 0:
        rejected = num_accepted < num_draft  # [num_reqs]
        rejected_ids = draft_ids[rows, num_accepted.clamp(max=max_k - 1)]  # [num_reqs]
        if draft_probs is None:
            rejected_draft_probs = torch.zeros_like(final_probs).scatter_(1, rejected_ids[:, None], 1.0)
        else:
            rejected_draft_probs = draft_probs[draft_rows[rows, num_accepted.clamp(max=max_k - 1)]]
        recovered = recovered_probs(final_probs, rejected_draft_probs)
        final_probs = torch.where(rejected[:, None], recovered, final_probs)
    # Numbers for every position a row may end on, then each row's at its final position.
    by_cdf = {} if race else standard
    uniforms = row_uniforms(num_reqs, max_k + 1, by_cdf, Lane.SAMPLE, target_probs.device, any_unseeded_random)
    final_ids = sample_categorical(final_probs, uniforms[rows, num_accepted])
    if race and standard:
        seeded_rows = sorted(standard)
        ends = num_accepted[seeded_rows].tolist()
        keys = [SeedKey(standard[r].seed, standard[r].position + n) for r, n in zip(seeded_rows, ends)]
        index = to_device(seeded_rows, torch.int64, final_ids.device)
        final_ids[index] = draw_seeded(final_probs[index], keys, Lane.SAMPLE, race=True)
    return final_ids


def greedy_verify(
    draft_token_ids: list[list[int]],  # per request, its k_i draft tokens
    target_argmax: list[int],  # per request in order, the target's argmax at its k_i + 1 verified positions
) -> RejectionOutput:
    """Greedy verification: accept drafts while each equals the target's argmax there, then
    emit the argmax at the first mismatch (recovered) or after the last draft (bonus)."""
    expected = sum(len(d) + 1 for d in draft_token_ids)
    if len(target_argmax) != expected:
        raise ValueError(f"target_argmax must hold {expected} ids (k_i + 1 per request), got {len(target_argmax)}")
    outputs, num_accepted, offset = [], [], 0
    for drafts in draft_token_ids:
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == target_argmax[offset + accepted]:
            accepted += 1
        outputs.append(list(drafts[:accepted]) + [target_argmax[offset + accepted]])
        num_accepted.append(accepted)
        offset += len(drafts) + 1
    return RejectionOutput(output_token_ids=outputs, num_accepted=num_accepted)


def _check_rows(num_reqs: int, greedy: torch.Tensor, seeded: dict[int, SeedKey]) -> None:
    if tuple(greedy.shape) != (num_reqs,) or greedy.dtype != torch.bool:
        raise ValueError(f"greedy must be a [{num_reqs}] bool tensor, got {tuple(greedy.shape)} {greedy.dtype}")
    if any(not 0 <= row < num_reqs for row in seeded):
        raise ValueError(f"seeded must be keyed by rows in [0, {num_reqs}), got {sorted(seeded)}")
