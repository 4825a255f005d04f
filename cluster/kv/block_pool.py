"""A fixed pool of KV-cache blocks with reference counts.

Pure bookkeeping: block ids index the preallocated K/V tensors the model runner owns.
Invariant: every block is either free (``ref_cnt == 0``, in the free queue once) or
used (``ref_cnt > 0``, not in the free queue).
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks (ref_cnt 1 each); raises if too few are free."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for b in blocks:
            self.ref_cnt[b] = 1
        return blocks

    def incref(self, block_id: int) -> None:
        if self.ref_cnt[block_id] == 0:
            raise RuntimeError(f"block {block_id} is free; take it through allocate()")
        self.ref_cnt[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks that reach zero become free."""
        for b in block_ids:
            if self.ref_cnt[b] <= 0:
                raise RuntimeError(f"double free of block {b}")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self._free.append(b)

    def check_invariants(self) -> None:
        free = list(self._free)
        if len(set(free)) != len(free):
            raise AssertionError("a block is in the free queue twice")
        free_set = set(free)
        for b in range(self.num_blocks):
            if (self.ref_cnt[b] == 0) != (b in free_set):
                raise AssertionError(f"block {b}: ref_cnt {self.ref_cnt[b]} but free={b in free_set}")
        if len(free_set) + sum(1 for c in self.ref_cnt if c > 0) != self.num_blocks:
            raise AssertionError("free + used != total")
