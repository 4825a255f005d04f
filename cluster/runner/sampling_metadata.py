"""The sampling state of one step: per-row settings as tensors for the logits processors and the sampler.

``SamplingMetadata`` holds what every row of a step's logits samples with (temperature,
filters, seeds, banned ids, grammar bitmask, logit bias, allowed ids) and ``PenaltyState``
the token statistics penalties read. The runner builds them once per step on the logits'
device; ``logits_processors`` and ``sampler`` only read them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cluster.runner.host_copy import to_device
from cluster.runner.random_stream import SeedKey
from cluster.shared.sampling_params import SamplingParams


def padded_token_ids(
    token_ids: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> torch.Tensor:
    """Rows of token ids as one ``[num_rows, max_len]`` int64 tensor padded with ``pad_id``.

    Ids >= ``pad_id`` are clamped to ``pad_id``: with ``pad_id == vocab_size`` they land in the
    extra bin that callers drop (a token the head cannot produce needs no penalty, as in HF).
    The width is at least 1 so that scatters always have a well-formed index.
    """
    max_len = max((len(ids) for ids in token_ids), default=0)
    out = np.full((len(token_ids), max(max_len, 1)), pad_id, dtype=np.int64)
    for row, ids in enumerate(token_ids):
        out[row, : len(ids)] = ids
    return to_device(out, None, device).clamp_(max=pad_id)


@dataclass(frozen=True)
class PenaltyState:
    """Per-row penalty settings and token statistics for one step.

    A row without penalties has presence 0, frequency 0 and repetition 1 and passes through
    ``apply_penalties`` bit-for-bit unchanged.
    """

    presence: torch.Tensor  # [num_reqs] float32
    frequency: torch.Tensor  # [num_reqs] float32
    repetition: torch.Tensor  # [num_reqs] float32
    output_counts: torch.Tensor  # [num_reqs, vocab_size] int32: occurrences among output tokens
    prompt_mask: torch.Tensor  # [num_reqs, vocab_size] bool: token occurs in the prompt

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device,
    ) -> PenaltyState:
        """Count tokens with one scatter over padded id matrices (pad id = ``vocab_size``).

        Only rows that use a penalty contribute ids: the prompt only matters for the
        repetition penalty and the output only when some penalty is on.
        """
        prompts = [ids if p.repetition_penalty != 1.0 else () for p, ids in zip(params, prompt_token_ids)]
        outputs = [ids if p.needs_penalties else () for p, ids in zip(params, output_token_ids)]
        num_reqs = len(params)

        output_ids = padded_token_ids(outputs, vocab_size, device)  # [num_reqs, max_output_len]
        output_counts = torch.zeros(num_reqs, vocab_size + 1, dtype=torch.int32, device=device)
        output_counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=torch.int32))

        prompt_ids = padded_token_ids(prompts, vocab_size, device)  # [num_reqs, max_prompt_len]
        prompt_mask = torch.zeros(num_reqs, vocab_size + 1, dtype=torch.bool, device=device)
        prompt_mask.scatter_(1, prompt_ids, True)

        def per_row(values: list[float]) -> torch.Tensor:
            return to_device(values, torch.float32, device)

        return cls(
            presence=per_row([p.presence_penalty for p in params]),
            frequency=per_row([p.frequency_penalty for p in params]),
            repetition=per_row([p.repetition_penalty for p in params]),
            output_counts=output_counts[:, :vocab_size],
            prompt_mask=prompt_mask[:, :vocab_size],
        )


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
            allowed = (to_device(allowed_rows, torch.int64, device), to_device(mask, None, device))
        num_logprobs = [p.logprobs for p in params if p.logprobs is not None]
        needs_penalties = any(p.needs_penalties for p in params)

        def per_row(values: list, dtype: torch.dtype) -> torch.Tensor:
            return to_device(values, dtype, device)

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
