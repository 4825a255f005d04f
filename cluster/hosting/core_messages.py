"""The messages between a replica and its engine core (``core.py``), in a process or a thread.

Replica -> core: ``CoreStart`` once, then ``AddRequest``, ``AbortRequest``, ``CallRequest``
and finally ``Shutdown``, in the order they were sent. Core -> replica: ``CoreReady`` once
the engine is built (or ``CoreMessage`` with ``failure`` when it cannot be), then one
``CoreMessage`` per engine step (and one per batch of requests handled while idle).
A step's message carries every request's delta of that step, so the hand-off costs one
message per step, not one per token per request. Plain pickled dataclasses over a
socket pair.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.hosting.backend import SpecState
from cluster.routing.stats import EngineLoad
from cluster.hosting.protocol import GenerateDelta, GenerateRequest
from cluster.metrics.sample_buffer import SampleBatch


@dataclass(frozen=True)
class CoreStart:
    config: dict  # TandemConfig.model_dump() of the group's engine settings
    step_time_scale: float = 1.0


@dataclass(frozen=True)
class AddRequest:
    request: GenerateRequest


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class CallRequest:
    """Ask the core for a reading it computes between steps (``engine_stats``, ``step_timeline``)."""

    call_id: int
    method: str
    args: tuple = ()


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class CoreSnapshot:
    """What the replica answers from without asking the core: the router's load, the
    predicted capacity, the speculation in force, and whether the engine has failed."""

    load: EngineLoad
    capacity_tokens_per_second: float
    spec_state: SpecState
    failed: str | None = None


@dataclass(frozen=True)
class CoreReady:
    max_model_len: int
    snapshot: CoreSnapshot
    pid: int


@dataclass(frozen=True)
class CallResult:
    call_id: int
    value: object = None
    error: str | None = None


@dataclass
class CoreMessage:
    # (request id, delta): acknowledgements, errors and tokens, in the order produced.
    deltas: list[tuple[str, GenerateDelta]] = field(default_factory=list)
    calls: list[CallResult] = field(default_factory=list)
    samples: SampleBatch | None = None
    snapshot: CoreSnapshot | None = None
    failure: str | None = None  # the core could not start, or stopped for good

    def __bool__(self) -> bool:
        return bool(self.deltas or self.calls or self.samples or self.snapshot or self.failure)
