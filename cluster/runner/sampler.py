"""The sampler: logits in, one token per request (and optionally logprobs) out.

Pipeline per row: grammar mask -> allowed ids -> logit bias -> penalties -> banned ids -> temperature -> top-k -> top-p -> min-p -> softmax,
then one draw by the inverse of the CDF (``categorical.py``). ``compute_probs`` and ``sample_from_probs`` are exposed separately
because the speculative rejection sampler needs the distribution itself: it calls
``compute_probs`` on target and draft logits and samples recovered and bonus tokens with
``sample_from_probs``.

Randomness: unseeded rows share one batched draw from the default generator of the device;
a seeded row's number for the token at output position ``t`` is a hash of its seed and ``t``
(``random_stream.py``), so its tokens depend on its seed and its own history, never on its
place in the batch, on the other rows or on how its earlier tokens were produced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from cluster.shared.sampling_params import SamplingParams
from cluster.runner.categorical import sample_categorical
from cluster.runner.random_stream import Lane, SeedKey, draw_seeded, row_uniforms
from cluster.structured.bitmask import apply_token_bitmask
from cluster.runner.logits_processors import (
    PenaltyState,
    apply_allowed_token_ids,
    apply_banned_token_ids,
    apply_logit_bias,
    apply_penalties,
    apply_temperature,
    apply_top_k_top_p_min_p,
)

__all__ = [
    "LogprobsTensors",
    "PenaltyState",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "apply_penalties",
    "compute_probs",
    "gather_logprobs",
    "sample_from_probs",
]


@dataclass(frozen=True)
class SamplingMetadata:
    """Per-step sampling state for the rows of a logits tensor (one row per request that samples).

    Invariants (kept by ``build``): ``temperature`` is exactly 0 on greedy rows and > 0 elsewhere;
    ``top_k`` is 0 when off or >= vocab_size; ``seeded`` and the filter flags only concern
    random rows; every banned id is in ``[0, vocab_size)``; tensors live on one device.
    """

    temperature: torch.Tensor  # [num_reqs] float32; 0 for greedy rows
    top_p: torch.Tensor  # [num_reqs] float32
    top_k: torch.Tensor  # [num_reqs] int64; 0 = off
    min_p: torch.Tensor  # [num_reqs] float32
    all_greedy: bool
    all_random: bool
    no_top_p_top_k_min_p: bool  # no random row uses top-p, top-k or min-p: skip the sort
    seeded: dict[int, SeedKey]  # row -> (seed, output position of its token): seeded random rows
    penalties: PenaltyState | None  # None when no row has a penalty
    banned_token_ids: dict[int, list[int]]  # row -> ids whose logits are set to -inf
    max_num_logprobs: int | None  # None when no row asks for logprobs
    seeded_race: bool = False  # seeded rows draw by an exponential race on keyed noise, not by the inverse CDF
    unit_temperature: bool = False  # every random row's temperature is 1: dividing by it is skipped (exact)
    token_bitmask: torch.Tensor | None = None  # [num_reqs, words] int32: allowed tokens (structured outputs)
    # (rows, token ids, values), int64/int64/float32, one entry per biased token; None: no row has a bias
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # (rows, [len(rows), vocab_size] bool: the ids each may take), for rows with allowed_token_ids; None: none has
    allowed_token_ids: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        seeds: Sequence[int | None],
        positions: Sequence[int],
        banned_token_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device,
        seeded_race: bool = False,
        token_bitmask: torch.Tensor | None = None,
    ) -> SamplingMetadata:
        """Gather one step's per-row settings into tensors on ``device``.

        ``seeds[i]`` is the seed row i draws with (None: the device's default generator) and
        ``positions[i]`` the output position of the token it samples. Banned ids outside the
        vocabulary are dropped: such a token can never be sampled anyway.
        """
        num_reqs = len(params)
        lengths = {len(prompt_token_ids), len(output_token_ids), len(seeds), len(positions), len(banned_token_ids)}
        if lengths != {num_reqs}:
            raise ValueError(
                "params, prompt_token_ids, output_token_ids, seeds, positions and banned_token_ids must "
                f"have one entry per request ({num_reqs}), got lengths {sorted(lengths)}"
            )
        greedy = [p.greedy for p in params]
        top_k = [0 if p.top_k >= vocab_size else p.top_k for p in params]
        filtered = [
            not g and (p.top_p < 1.0 or k > 0 or p.min_p > 0.0) for p, g, k in zip(params, greedy, top_k)
        ]
        banned = {
            row: valid
            for row, ids in enumerate(banned_token_ids)
            if (valid := sorted({t for t in ids if 0 <= t < vocab_size}))
        }
        biased = [(row, token, value) for row, p in enumerate(params) for token, value in p.logit_bias.items()
                  if token < vocab_size]
        allowed_rows = [row for row, p in enumerate(params) if p.allowed_token_ids is not None]
        allowed = None
        if allowed_rows:
            mask = torch.zeros(len(allowed_rows), vocab_size, dtype=torch.bool)
            for i, row in enumerate(allowed_rows):
                mask[i, [t for t in params[row].allowed_token_ids if t < vocab_size]] = True
            allowed = (torch.tensor(allowed_rows, dtype=torch.int64, device=device), mask.to(device))
        num_logprobs = [p.logprobs for p in params if p.logprobs is not None]
        needs_penalties = any(p.needs_penalties for p in params)

        def per_row(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperature=per_row([0.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32),
            top_p=per_row([p.top_p for p in params], torch.float32),
            top_k=per_row(top_k, torch.int64),
            min_p=per_row([p.min_p for p in params], torch.float32),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            no_top_p_top_k_min_p=not any(filtered),
            seeded={row: SeedKey(seed, positions[row]) for row, seed in enumerate(seeds)
                    if seed is not None and not greedy[row]},
            penalties=(
                PenaltyState.build(params, prompt_token_ids, output_token_ids, vocab_size, device)
                if needs_penalties
                else None
            ),
            banned_token_ids=banned,
            max_num_logprobs=max(num_logprobs) if num_logprobs else None,
            seeded_race=seeded_race,
            unit_temperature=all(g or p.temperature == 1.0 for p, g in zip(params, greedy)),
            token_bitmask=None if token_bitmask is None else token_bitmask.to(device, non_blocking=True),
            logit_bias=None if not biased else (
                per_row([b[0] for b in biased], torch.int64), per_row([b[1] for b in biased], torch.int64),
                per_row([float(b[2]) for b in biased], torch.float32)),
            allowed_token_ids=allowed,
        )

    @property
    def greedy_mask(self) -> torch.Tensor:  # [num_reqs] bool
        return self.temperature == 0


class LogprobsTensors(NamedTuple):
    """Raw logprobs (log_softmax of the model's logits before any processing).

    The width is ``1 + min(max_num_logprobs, vocab_size)``; each request slices its own count.
    """

    token_ids: torch.Tensor  # [num_reqs, 1 + max_num_logprobs] int64: the sampled token, then the top ones
    logprobs: torch.Tensor  # [num_reqs, 1 + max_num_logprobs] float32
    sampled_rank: torch.Tensor  # [num_reqs] int64: 1 + number of tokens with a strictly greater logprob


class SamplerOutput(NamedTuple):
    sampled_token_ids: torch.Tensor  # [num_reqs] int64
    logprobs: LogprobsTensors | None


def _penalized_logits(
    logits: torch.Tensor,  # [num_reqs, vocab_size] any float dtype
    metadata: SamplingMetadata,
) -> torch.Tensor:  # [num_reqs, vocab_size] float32
    """The logits greedy rows take the argmax of: float32, the grammar's mask, allowed ids, logit bias
    (before the penalties, as vLLM), penalties, banned ids."""
    logits = logits.float()
    if metadata.token_bitmask is not None:
        logits = apply_token_bitmask(logits, metadata.token_bitmask)
    logits = apply_logit_bias(apply_allowed_token_ids(logits, metadata), metadata)
    return apply_banned_token_ids(apply_penalties(logits, metadata), metadata)


def greedy_token_ids(
    logits: torch.Tensor,  # [num_reqs, vocab_size] any float dtype
    metadata: SamplingMetadata,
) -> torch.Tensor:  # [num_reqs] int64
    """What greedy rows emit: the argmax of their penalized logits (first index on ties)."""
    return _penalized_logits(logits, metadata).argmax(dim=-1)


def _one_hot(
    token_ids: torch.Tensor,  # [num_reqs] int64
    vocab_size: int,
) -> torch.Tensor:  # [num_reqs, vocab_size] float32
    out = torch.zeros(token_ids.shape[0], vocab_size, dtype=torch.float32, device=token_ids.device)
    return out.scatter_(1, token_ids[:, None], 1.0)


def compute_probs(
    logits: torch.Tensor,  # [num_reqs, vocab_size] any float dtype
    metadata: SamplingMetadata,
) -> torch.Tensor:  # [num_reqs, vocab_size] float32
    """The distribution each row samples from; a pure function of (logits, metadata).

    Greedy rows get a one-hot of the argmax of their penalized logits (first index on ties),
    so a greedy request's speculative tokens are accepted exactly when they match it.
    """
    logits = _penalized_logits(logits, metadata)
    if metadata.all_greedy:
        return _one_hot(logits.argmax(dim=-1), logits.shape[-1])
    greedy_probs = None if metadata.all_random else _one_hot(logits.argmax(dim=-1), logits.shape[-1])
    logits = apply_temperature(logits, metadata)
    if not metadata.no_top_p_top_k_min_p:
        logits = apply_top_k_top_p_min_p(logits, metadata)
    probs = logits.softmax(dim=-1)
    if greedy_probs is not None:
        probs = torch.where(metadata.greedy_mask[:, None], greedy_probs, probs)
    return probs


def sample_from_probs(
    probs: torch.Tensor,  # [num_reqs, vocab_size] float32
    metadata: SamplingMetadata,
    lane: Lane = Lane.SAMPLE,
) -> torch.Tensor:  # [num_reqs] int64
    """Greedy rows: argmax. Random rows: one draw from ``probs`` by the inverse of its CDF
    (``sample_categorical``), which never picks a token of probability 0. Unseeded rows share
    one batched draw; a seeded row uses the numbers of its seed and position in ``lane`` (by an
    exponential race when ``metadata.seeded_race``).
    """
    if metadata.all_greedy:
        return probs.argmax(dim=-1)
    num_rows, seeded = probs.shape[0], metadata.seeded
    by_cdf = {} if metadata.seeded_race else seeded
    uniforms = row_uniforms(num_rows, 1, by_cdf, lane, probs.device, len(by_cdf) < num_rows)
    random_ids = sample_categorical(probs, uniforms[:, 0])
    if metadata.seeded_race and seeded:
        rows = sorted(seeded)
        index = torch.tensor(rows, device=probs.device)
        random_ids[index] = draw_seeded(probs[index], [seeded[r] for r in rows], lane, race=True)
    if metadata.all_random:
        return random_ids
    return torch.where(metadata.greedy_mask, probs.argmax(dim=-1), random_ids)


def gather_logprobs(
    raw_logprobs: torch.Tensor,  # [num_reqs, vocab_size] float32
    sampled_token_ids: torch.Tensor,  # [num_reqs] int64
    num_logprobs: int,
) -> LogprobsTensors:
    """The sampled token's logprob and rank, then the top ``num_logprobs`` in descending order."""
    sampled = sampled_token_ids[:, None]  # [num_reqs, 1]
    sampled_logprobs = raw_logprobs.gather(1, sampled)  # [num_reqs, 1]
    sampled_rank = (raw_logprobs > sampled_logprobs).sum(dim=-1) + 1
    top_logprobs, top_ids = raw_logprobs.topk(min(num_logprobs, raw_logprobs.shape[-1]), dim=-1)
    return LogprobsTensors(
        token_ids=torch.cat([sampled, top_ids], dim=1),
        logprobs=torch.cat([sampled_logprobs, top_logprobs], dim=1),
        sampled_rank=sampled_rank,
    )


class Sampler(torch.nn.Module):
    """Samples one token per row; stateless."""

    def forward(
        self,
        logits: torch.Tensor,  # [num_reqs, vocab_size] any float dtype
        metadata: SamplingMetadata,
    ) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = None if metadata.max_num_logprobs is None else logits.log_softmax(dim=-1)
        if metadata.all_greedy:
            sampled = greedy_token_ids(logits, metadata)
        else:
            sampled = sample_from_probs(compute_probs(logits, metadata), metadata)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)
