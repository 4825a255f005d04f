"""A snapshot of an engine's counters, for routing and metrics."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.spec_decode.stats import SpecDecodeStats


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks held by requests, in [0, 1]
    num_preemptions: int  # since start
    num_computed_tokens: int  # tokens that went through the model since start
    prefix_cache_queries: int  # tokens looked up in the prefix cache since start
    prefix_cache_hits: int  # of those, tokens found
    num_cached_blocks: int  # blocks currently findable in the prefix cache
    spec: SpecDecodeStats | None = None  # speculative decoding counters, when it is on

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
