"""A fixed pool of KV-cache blocks with reference counts and a prefix cache.

Pure bookkeeping: block ids index the preallocated K/V tensors the model runner owns.

Every block is either *used* (``ref_cnt > 0``) or *free* (``ref_cnt == 0``, in the free
queue exactly once). A block may also be *cached*: it holds a full, verified block
of tokens under a :class:`BlockHash` and can be found by that name, whether used
(shared by several requests) or free (kept until its memory is needed).

The free queue is least-recently-freed first. Allocation takes from its front and
evicts the block's cached name, if any. Requests free their blocks tail first, so
a block is always queued after its children: leaves are evicted before their
parents, and a shared prefix outlives the branches hanging off it. A block that is
in use is never in the queue, so a referenced prefix is never evicted. Lookup, hit
(``touch``), free and eviction are O(1) per block. The cached names are also indexed by
their parent's, so the prefix tree's top levels are walked without visiting the rest.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from cluster.kv.prefix_cache import BlockHash


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._cached: dict[int, int] = {}  # hash value -> block id
        self._children: dict[int, set[int]] = {}  # parent hash value -> the cached values under it
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation can take (cached-but-unused ones included)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def is_free(self, block_id: int) -> bool:
        return self.ref_cnt[block_id] == 0

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks from the front of the free queue (ref_cnt 1 each),
        evicting their cached names; raises if too few are free."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self.ref_cnt[block_id] = 1
            blocks.append(block_id)
        return blocks

    def touch(self, block_ids: list[int]) -> None:
        """Take one more reference on cached blocks found by a prefix lookup."""
        for b in block_ids:
            if self.ref_cnt[b] == 0:
                del self._free[b]
            self.ref_cnt[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block, in order; blocks that reach zero join the
        back of the free queue (most recently used), keeping their cached names."""
        for b in block_ids:
            if self.ref_cnt[b] <= 0:
                raise RuntimeError(f"double free of block {b}")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self._free[b] = None

    # ---- the prefix cache ---------------------------------------------------------
    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block cached under this name, only if its content matches exactly."""
        block_id = self._cached.get(block_hash.value)
        if block_id is None:
            return None
        stored = self.block_hash[block_id]
        return block_id if stored is not None and stored.same_content(block_hash) else None

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Name a used, fully computed block. A name already taken (the same content
        computed twice, or a hash collision) leaves this block uncached."""
        if not self.enable_caching or self.block_hash[block_id] is not None:
            return False
        if block_hash.value in self._cached:
            return False
        self._cached[block_hash.value] = block_id
        self._children.setdefault(block_hash.parent_value, set()).add(block_hash.value)
        self.block_hash[block_id] = block_hash
        return True

    def cached_children(self, parent_value: int) -> set[int] | tuple[()]:
        """The hash values of the cached blocks whose parent is ``parent_value`` (do not modify)."""
        return self._children.get(parent_value, ())

    def forget(self, named: Callable[[BlockHash], bool]) -> int:
        """Drop the cached names ``named`` picks from blocks no request holds (their KV is no longer
        what the name says); how many."""
        stale = [b for b in self._cached.values() if self.ref_cnt[b] == 0 and named(self.block_hash[b])]
        for b in stale:
            self._evict(b)
        return len(stale)

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            del self._cached[block_hash.value]
            siblings = self._children[block_hash.parent_value]
            siblings.discard(block_hash.value)
            if not siblings:
                del self._children[block_hash.parent_value]
            self.block_hash[block_id] = None
            self.num_evictions += 1

    def check_invariants(self) -> None:
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise AssertionError("a block is in the free queue twice")
        for b in range(self.num_blocks):
            if (self.ref_cnt[b] == 0) != (b in free_set):
                raise AssertionError(f"block {b}: ref_cnt {self.ref_cnt[b]} but free={b in free_set}")
            if self.ref_cnt[b] < 0:
                raise AssertionError(f"block {b}: negative ref_cnt")
        for value, b in self._cached.items():
            if self.block_hash[b] is None or self.block_hash[b].value != value:
                raise AssertionError(f"cached name {value:#x} points at block {b} that does not carry it")
        indexed = {(parent, value) for parent, values in self._children.items() for value in values}
        if indexed != {(self.block_hash[b].parent_value, v) for v, b in self._cached.items()}:
            raise AssertionError("the parent -> children index differs from the cached names")
        named = sum(1 for h in self.block_hash if h is not None)
        if named != len(self._cached):
            raise AssertionError(f"{named} blocks carry names but {len(self._cached)} are cached")
