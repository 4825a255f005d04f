"""Chained block hashes: how a full block of tokens is named in the prefix cache.

Block ``i`` of a request is named by ``hash(name of block i-1, token ids of block i,
extra keys)``, so a name stands for the whole prefix up to and including the block,
and the names of a request's blocks form a path in a tree rooted at the empty
prefix. ``extra_keys`` carries whatever changes the KV for the same tokens (the
model, a per-request ``cache_salt``). The hash is xxHash's XXH3-64, seeded per engine.

A 64-bit name can collide, so every cached block keeps its token ids and its parent's
name beside it, and a lookup accepts a block only when both match exactly.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Callable, Sequence

import xxhash

# (seed, parent hash, token ids, extra keys) -> 64-bit hash; tests inject colliding ones.
HashFunction = Callable[[int, int, Sequence[int], tuple], int]

ROOT_HASH = 0  # the parent of a request's first block


def xxh3_block_hash(seed: int, parent_hash: int, token_ids: Sequence[int], extra_keys: tuple) -> int:
    hasher = xxhash.xxh3_64(seed=seed)
    hasher.update(parent_hash.to_bytes(8, "little"))
    hasher.update(array("q", token_ids).tobytes())
    if extra_keys:
        hasher.update(repr(extra_keys).encode())
    return hasher.intdigest()


def engine_hash_seed(model: str, dtype: str, seed: int) -> int:
    """The hash seed of an engine: blocks are only shared between requests to the same
    model in the same dtype. The router computes it too, to match prompts to caches."""
    return xxhash.xxh64_intdigest(f"{model}|{dtype}".encode(), seed=seed)


@dataclass(frozen=True)
class BlockHash:
    """The name of one full block, with what is needed to rule out a collision."""

    value: int
    parent_value: int
    token_ids: tuple[int, ...]
    extra_keys: tuple

    def same_content(self, other: "BlockHash") -> bool:
        return (
            self.parent_value == other.parent_value
            and self.token_ids == other.token_ids
            and self.extra_keys == other.extra_keys
        )


class BlockHasher:
    """Names the full blocks of token sequences, seeded per engine."""

    def __init__(self, block_size: int, seed: int, hash_fn: HashFunction = xxh3_block_hash) -> None:
        self.block_size = block_size
        self.seed = seed
        self.hash_fn = hash_fn

    def extend(
        self, hashes: list[BlockHash], token_ids: Sequence[int], num_tokens: int, extra_keys: tuple
    ) -> list[BlockHash]:
        """Append names for every full block among the first ``num_tokens`` tokens that
        ``hashes`` does not name yet; returns the new ones."""
        new: list[BlockHash] = []
        bs = self.block_size
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[-1].value if hashes else ROOT_HASH
            block_tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            value = self.hash_fn(self.seed, parent, block_tokens, extra_keys)
            block_hash = BlockHash(value, parent, block_tokens, extra_keys)
            hashes.append(block_hash)
            new.append(block_hash)
        return new
