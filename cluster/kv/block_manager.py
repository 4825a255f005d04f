"""Per-request block tables over a :class:`BlockPool`.

A request's block table maps its token positions to KV blocks: position ``p`` lives in
block ``block_table[p // block_size]`` at offset ``p % block_size``. Tables only grow,
until the request is freed (finish, abort or preemption), which returns its blocks.
"""

from __future__ import annotations

from cluster.kv.block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool in use, in [0, 1]."""
        return self.pool.num_used_blocks / self.pool.num_blocks

    def num_blocks_needed(self, request_id: str, num_total_tokens: int) -> int:
        """Blocks to add so the request can hold ``num_total_tokens`` tokens."""
        have = len(self.block_tables.get(request_id, ()))
        return max(0, cdiv(num_total_tokens, self.block_size) - have)

    def allocate_slots(
        self,
        request_id: str,
        num_computed_tokens: int,
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Make room for ``num_new_tokens`` (+ lookahead slots for draft tokens).

        Returns False, changing nothing, when the pool has too few free blocks.
        """
        total = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        needed = self.num_blocks_needed(request_id, total)
        if needed > self.pool.num_free_blocks:
            return False
        table = self.block_tables.setdefault(request_id, [])
        if needed:
            table.extend(self.pool.allocate(needed))
        return True

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def free(self, request_id: str) -> None:
        """Release every block the request holds; a no-op for unknown ids."""
        table = self.block_tables.pop(request_id, None)
        if table:
            # Free the tail first so that, with prefix caching, leaves are evicted first.
            self.pool.free(list(reversed(table)))

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        counts = [0] * self.pool.num_blocks
        for table in self.block_tables.values():
            for b in table:
                counts[b] += 1
        for b, c in enumerate(counts):
            if self.pool.ref_cnt[b] != c:
                raise AssertionError(f"block {b}: ref_cnt {self.pool.ref_cnt[b]}, held by {c} tables")
