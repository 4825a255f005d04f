"""Counter-based random numbers: one uniform per (seed, lane, output position).

A seeded request's numbers for output token ``t`` depend on its seed and ``t`` alone, never on
how many numbers were drawn before: whatever steps, batch partners, preemptions and draft
lengths produced tokens ``0 .. t-1``, token ``t`` is drawn with the same numbers. A *lane*
separates the uses one position has for randomness (the token's own draw, rejection
sampling's acceptance test, a draft model's draw), so they stay independent of each other.

The key is a hash: splitmix64's finalizer (Steele, Lea and Flood, 2014), chained over the
seed, the lane and the position, computed with numpy's wrapping uint64 arithmetic on the
host (a handful of numbers per request and step, copied to the device in one transfer). Its
top 24 bits make a float32 in ``[0, 1)`` exactly: the one uniform an inverse-CDF draw needs.
An exponential race (Gumbel-max) needs one number per vocabulary entry: ``keyed_exponentials``
seeds a torch generator of the device with the key and draws them, so the same key gives the
same noise on the same kind of device. Rows without a seed draw from the device's default
generator instead, in one batched call.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import IntEnum
from typing import NamedTuple

import numpy as np
import torch

from cluster.runner.categorical import sample_categorical, sample_race
from cluster.runner.host_copy import to_device

_UINT64 = (1 << 64) - 1


class Lane(IntEnum):
    SAMPLE = 0  # the token drawn at a position: plain sampling, the coupled verifier, a coupled draft
    ACCEPT = 1  # rejection sampling's acceptance test at a position
    DRAFT = 2  # a draft model's own draw when the target verifies by rejection sampling


class SeedKey(NamedTuple):
    """Where a row's numbers come from: the request's seed and the output position of the
    row's (first) token."""

    seed: int
    position: int


def _mix(z: np.ndarray) -> np.ndarray:  # uint64 -> uint64, a bijection
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _keys(seeds: list[int], positions: list[int], lane: Lane) -> np.ndarray:  # [n] uint64
    if len(seeds) != len(positions):
        raise ValueError(f"one position per seed: got {len(seeds)} seeds and {len(positions)} positions")
    if any(p < 0 for p in positions):
        raise ValueError(f"output positions are >= 0, got {min(positions)}")
    keys = np.array([s & _UINT64 for s in seeds], dtype=np.uint64)
    with np.errstate(over="ignore"):
        return _mix(_mix(_mix(keys) + np.uint64(int(lane))) + np.asarray(positions, dtype=np.uint64))


def counter_uniforms(seeds: list[int], positions: list[int], lane: Lane) -> np.ndarray:  # [n] float32 in [0, 1)
    """The uniform of each (seed, position) pair in ``lane``; any Python int is a seed (taken mod 2**64)."""
    return (_keys(seeds, positions, lane) >> np.uint64(40)).astype(np.float32) / np.float32(1 << 24)


def keyed_exponentials(
    keys: list[SeedKey],  # one per row
    lane: Lane,
    vocab_size: int,
    device: torch.device,
) -> torch.Tensor:  # [num_rows, vocab_size] float32, Exponential(1)
    """Per row, ``vocab_size`` exponential numbers from a generator seeded with the row's key;
    a uniform of exactly 0 gives +inf (that entry then never wins a race)."""
    hashes = _keys([k.seed for k in keys], [k.position for k in keys], lane) >> np.uint64(1)  # torch seeds < 2**63
    out = torch.empty(len(keys), vocab_size, device=device)
    for row, key in enumerate(hashes.tolist()):
        out[row].uniform_(generator=torch.Generator(device=device).manual_seed(key))
    return out.log_().neg_()


def row_uniforms(
    num_rows: int,
    width: int,
    seeded: Mapping[int, SeedKey],  # row -> its key; column j of the row is position key.position + j
    lane: Lane,
    device: torch.device,
    draw_unseeded: bool,  # rows without a key draw from the default generator (else they hold 0)
) -> torch.Tensor:  # [num_rows, width] float32 in [0, 1)
    """Uniforms for a batch: counter-based for seeded rows, one batched draw for the others."""
    if draw_unseeded:
        out = torch.rand(num_rows, width, device=device)
    else:
        out = torch.zeros(num_rows, width, device=device)
    if seeded and width > 0:
        rows = sorted(seeded)
        seeds = [seeded[r].seed for r in rows for _ in range(width)]
        positions = [seeded[r].position + j for r in rows for j in range(width)]
        values = torch.from_numpy(counter_uniforms(seeds, positions, lane)).view(len(rows), width)
        out[to_device(rows, torch.int64, device)] = to_device(values, None, device)
    return out


def draw_seeded(
    probs: torch.Tensor,  # [num_rows, vocab_size] float32, non-negative
    keys: list[SeedKey],  # one per row: the row's token is drawn for key.position
    lane: Lane,
    race: bool,  # exponential race on keyed noise (Gumbel-max); else inverse CDF with the keyed uniform
) -> torch.Tensor:  # [num_rows] int64
    """One token per row from its key's numbers: the same key and row give the same token."""
    if race:
        return sample_race(probs, keyed_exponentials(keys, lane, probs.shape[1], probs.device))
    uniforms = counter_uniforms([k.seed for k in keys], [k.position for k in keys], lane)
    return sample_categorical(probs, to_device(uniforms, None, probs.device))
