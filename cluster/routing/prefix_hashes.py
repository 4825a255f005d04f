"""The names the engine gives a prompt's leading full blocks, computed outside the engine.

The router matches these against the ``cached_prefix_hashes`` a replica publishes to
estimate how much of a prompt that replica would not have to prefill. They must equal,
value for value, what the engine's ``BlockManager`` assigns to ``request.block_hashes``:
the same :class:`~cluster.kv.prefix_cache.BlockHasher` with the same block size and
per-engine seed, and the same extra keys as ``Request.extra_keys`` (``cache_extra_keys``:
the cache salt and the LoRA adapter, when given). A router that hashes with another seed or
block size simply finds no matches: affinity is lost, nothing breaks.
"""

from __future__ import annotations

from cluster.kv.prefix_cache import BlockHasher
from cluster.shared.request import cache_extra_keys


def leading_block_hashes(
    token_ids: list[int],
    block_size: int,
    hash_seed: int,
    max_blocks: int,
    cache_salt: str | None = None,
    lora_name: str | None = None,
) -> tuple[int, ...]:
    """Hash values of the first ``min(max_blocks, len(token_ids) // block_size)`` full
    blocks of ``token_ids``, block 0 first. Only the tokens of those blocks are hashed."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    if max_blocks <= 0:
        return ()
    extra_keys = cache_extra_keys(cache_salt, lora_name)
    num_tokens = min(len(token_ids), max_blocks * block_size)
    hashes = BlockHasher(block_size, hash_seed).extend([], token_ids, num_tokens, extra_keys)
    return tuple(h.value for h in hashes)
