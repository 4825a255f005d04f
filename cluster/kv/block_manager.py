"""Per-request block tables over a :class:`BlockPool`, with prefix-cache lookups.

A request's block table maps its token positions to KV blocks: position ``p`` lives in
block ``block_table[p // block_size]`` at offset ``p % block_size``. Tables only grow
until the request is freed (finish, abort or preemption), which drops its references.

With prefix caching, a new (or preempted) request first looks up the longest run of
its full blocks that is cached, shares those blocks, and computes only the rest. A
hit never covers the last token: its logits are needed to sample. The blocks a running
request is still computing are known by name too (:meth:`claim_in_flight`), so that a
request whose next block another one is computing can wait for it instead of computing
it again (:meth:`computed_elsewhere`).
"""

from __future__ import annotations

from typing import NamedTuple

from cluster.shared.request import Request
from cluster.kv.block_pool import BlockPool
from cluster.kv.prefix_cache import ROOT_HASH, BlockHash, BlockHasher, HashFunction, xxh3_block_hash


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class CachedPrefix(NamedTuple):
    block_ids: list[int]
    num_tokens: int


NO_PREFIX = CachedPrefix([], 0)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_seed: int = 0,
        hash_fn: HashFunction = xxh3_block_hash,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.hasher = BlockHasher(block_size, hash_seed, hash_fn)
        self.block_tables: dict[str, list[int]] = {}
        self._num_cached_in_table: dict[str, int] = {}  # leading blocks of a table already named
        # Full blocks running requests will compute, by name: hash value -> (request id, name).
        self._in_flight: dict[int, tuple[str, BlockHash]] = {}
        self._in_flight_of: dict[str, list[int]] = {}  # request id -> the hash values it claimed
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests, in [0, 1]."""
        return self.pool.num_used_blocks / self.pool.num_blocks

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """The longest cached run of the request's leading full blocks, leaving at least
        its last token to compute. Takes nothing: pass the result to ``allocate_slots``."""
        if not self.enable_caching:
            return NO_PREFIX
        self.hasher.extend(request.block_hashes, request.all_token_ids, request.num_tokens, request.extra_keys)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return CachedPrefix(blocks, len(blocks) * self.block_size)

    def computed_elsewhere(self, request: Request, cached: CachedPrefix) -> bool:
        """Whether the block right after the request's ``cached`` prefix (from
        :meth:`find_cached_prefix`) is one another running request is computing now: the
        request then shares it by waiting a step or more rather than computing it too."""
        index = len(cached.block_ids)
        max_blocks = min(len(request.block_hashes), (request.num_tokens - 1) // self.block_size)
        if not self.enable_caching or index >= max_blocks:
            return False
        block_hash = request.block_hashes[index]
        claim = self._in_flight.get(block_hash.value)
        return claim is not None and claim[0] != request.request_id and claim[1].same_content(block_hash)

    def claim_in_flight(self, request: Request, num_cached_blocks: int) -> None:
        """Name the full blocks an admitted request will compute past its ``num_cached_blocks``
        shared ones (as far as :meth:`find_cached_prefix` named them); each is released once
        cached, or when the request frees its blocks."""
        if not self.enable_caching:
            return
        claimed = self._in_flight_of.setdefault(request.request_id, [])
        for block_hash in request.block_hashes[num_cached_blocks:]:
            if block_hash.value not in self._in_flight:
                self._in_flight[block_hash.value] = (request.request_id, block_hash)
                claimed.append(block_hash.value)

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (a failed admission retries without counting)."""
        if self.enable_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self,
        request_id: str,
        num_computed_tokens: int,
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        cached: CachedPrefix = NO_PREFIX,
    ) -> bool:
        """Make room for ``num_new_tokens`` (+ lookahead slots for draft tokens) after
        ``num_computed_tokens``, first sharing the ``cached`` prefix blocks if given.

        Returns False, changing nothing, when the pool has too few free blocks.
        """
        table = self.block_tables.get(request_id, [])
        total = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        needed = max(0, cdiv(total, self.block_size) - len(table) - len(cached.block_ids))
        # Cached blocks that sit in the free queue stop being available once shared.
        available = self.pool.num_free_blocks - sum(1 for b in cached.block_ids if self.pool.is_free(b))
        if needed > available:
            return False
        table = self.block_tables.setdefault(request_id, table)
        if cached.block_ids:
            self.pool.touch(cached.block_ids)
            table.extend(cached.block_ids)
            self._num_cached_in_table[request_id] = len(cached.block_ids)
        if needed:
            table.extend(self.pool.allocate(needed))
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Name every full block whose tokens are all computed (and verified), so later
        requests can share it."""
        if not self.enable_caching:
            return
        table = self.block_tables.get(request.request_id)
        if not table:
            return
        self.hasher.extend(request.block_hashes, request.all_token_ids, request.num_computed_tokens,
                           request.extra_keys)
        start = self._num_cached_in_table.get(request.request_id, 0)
        end = min(request.num_computed_tokens // self.block_size, len(table))
        for i in range(start, end):
            self.pool.cache_block(table[i], request.block_hashes[i])
            self._release_claim(request.request_id, request.block_hashes[i].value)
        self._num_cached_in_table[request.request_id] = max(start, end)

    def _release_claim(self, request_id: str, value: int) -> None:
        claim = self._in_flight.get(value)
        if claim is not None and claim[0] == request_id:
            del self._in_flight[value]

    def cached_prefix_hashes(self, max_depth: int) -> frozenset[int]:
        """Hash values of cached blocks at depth ``< max_depth`` in the prefix tree, for
        prefix-affinity routing.

        A block whose parent is ``ROOT_HASH`` (a prompt's first block) has depth 0; any
        other block has its parent's depth + 1, and only when its parent is itself cached:
        a block hanging off an evicted parent is unreachable by a lookup and is left out.
        Walks the pool's parent index from the root, so it costs O(blocks returned), not
        O(blocks cached): the engine core publishes this every few steps.
        """
        found: set[int] = set()
        level = self.pool.cached_children(ROOT_HASH)
        for _ in range(max_depth):
            if not level:
                break
            found.update(level)
            level = [child for value in level for child in self.pool.cached_children(value)]
        return frozenset(found)

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def free(self, request_id: str) -> None:
        """Release every block the request holds; a no-op for unknown ids."""
        table = self.block_tables.pop(request_id, None)
        self._num_cached_in_table.pop(request_id, None)
        for value in self._in_flight_of.pop(request_id, ()):
            self._release_claim(request_id, value)
        if table:
            # Tail first, so leaves enter the free queue (and are evicted) before parents.
            self.pool.free(list(reversed(table)))

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        for value, (request_id, _) in self._in_flight.items():
            if request_id not in self.block_tables or value not in self._in_flight_of.get(request_id, ()):
                raise AssertionError(f"block name {value} claimed by {request_id}, which holds no blocks")
        counts = [0] * self.pool.num_blocks
        for table in self.block_tables.values():
            for b in table:
                counts[b] += 1
        for b, c in enumerate(counts):
            if self.pool.ref_cnt[b] != c:
                raise AssertionError(f"block {b}: ref_cnt {self.pool.ref_cnt[b]}, held by {c} tables")
