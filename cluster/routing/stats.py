"""What a replica tells the router about itself, and what the router knows of a request.

A replica publishes a ``ReplicaStats`` every routing-stats period (Ray Serve's
``record_routing_stats`` carries it as a plain dict: ``to_dict`` / ``from_dict``). The
router combines it with the requests it has itself sent to the replica since
(``Candidate.num_inflight``) and a ``RoutingRequest`` describing the new request.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import NamedTuple


@dataclass(frozen=True)
class EngineLoad:
    """What an engine says of its load: the engine face's ``load()`` and the router's view of a
    replica (``ReplicaStats`` adds who and when)."""

    num_running: int
    num_waiting: int
    max_num_seqs: int
    kv_cache_usage: float  # fraction of KV blocks held by requests, [0, 1]
    current_k: int  # speculation length chosen at the latest step (0: plain decoding)
    # Accepted draft tokens / draft positions asked for so far, [0, 1], so that 1 + k * acceptance is
    # the tokens a request gains per step (vLLM replicas: accepted / proposed, all their counters give).
    acceptance: float
    # Seconds per decoding step at batch size b with the current k, from the replica's
    # device profile (already corrected by speed_factor); sorted by batch size.
    step_time_curve: tuple[tuple[int, float], ...] = ()
    # Seconds of prefill per prompt token not found in the prefix cache.
    prefill_seconds_per_token: float = 0.0
    # Measured step time / profiled step time on recent steps (1.0: as profiled). Already
    # folded into step_time_curve; published for dashboards.
    speed_factor: float = 1.0
    # Names (engine block hashes) of cached blocks within the first ``max_depth`` blocks
    # of some prompt; the router matches a request's leading block hashes against them.
    cached_prefix_hashes: frozenset[int] = field(default_factory=frozenset)
    block_size: int = 16
    # LoRA adapters loaded now, and the mean seconds a load from model.lora_dir has taken (0: none
    # measured); a request for an adapter not loaded pays that before its prefill.
    lora_adapters: frozenset[str] = field(default_factory=frozenset)
    lora_load_seconds: float = 0.0


@dataclass(frozen=True, kw_only=True)
class ReplicaStats(EngineLoad):
    """A replica's load as the router sees it: the engine's ``EngineLoad`` and who and when."""

    replica_id: str
    group: str  # the replica group (one Serve deployment per group)
    device_kind: str  # e.g. "cpu", "H100", "A10G"
    timestamp: float  # time.time() when measured, seconds

    def to_dict(self) -> dict:
        data = asdict(self)
        data["step_time_curve"] = [list(p) for p in self.step_time_curve]
        data["cached_prefix_hashes"] = sorted(self.cached_prefix_hashes)
        data["lora_adapters"] = sorted(self.lora_adapters)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "ReplicaStats":
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["step_time_curve"] = tuple((int(b), float(t)) for b, t in values.get("step_time_curve", ()))
        values["cached_prefix_hashes"] = frozenset(int(h) for h in values.get("cached_prefix_hashes", ()))
        values["lora_adapters"] = frozenset(values.get("lora_adapters", ()))
        return cls(**values)


@dataclass(frozen=True)
class RoutingRequest:
    num_prompt_tokens: int
    # The decode length the cost model assumes: the request's max_tokens, or a nominal length
    # when the caller set none (``cluster.api.engine_requests``).
    expected_output_tokens: int
    # Engine block hashes of the prompt's leading full blocks, in order (block 0 first).
    prefix_hashes: tuple[int, ...] = ()
    lora: str | None = None  # the LoRA adapter it runs with
    avoid_replica: str | None = None  # a replica whose engine just failed it: another one, if any, takes it


class Candidate(NamedTuple):  # a NamedTuple: one per replica per request
    replica_id: str
    stats: ReplicaStats | None  # None: the replica has not published yet
    num_inflight: int = 0  # requests this router sent there that have not finished
