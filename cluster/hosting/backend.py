"""The one interface a replica hosts an engine through (Tandem's own, or vLLM).

A replica (``deployments/replica.py``) builds its backend with ``cluster.backends.factory.build_backend``
from the group's engine settings and then only talks to :class:`EngineBackend`:

- ``generate(request)`` streams ``GenerateDelta``s: first exactly one acknowledgement
  (``accepted`` set, no tokens) or one error delta (bad input: 400, queue full: 429,
  engine failure: 500), then the token deltas, the last one carrying a finish reason.
  Closing the stream before its last delta (a client that went away) aborts the
  request in the engine and frees its KV blocks.
- ``load()`` is what the router needs (the engine half of ``ReplicaStats``), and
  ``spec_state()`` the speculation in force; ``engine_stats()`` and ``step_timeline()``
  are debug views.
- metrics go to the ``MetricsSink`` of the :class:`BackendContext` under the names of
  ``cluster/metrics/catalog.py``, the same series from every backend.
- ``suffix_history()`` and ``seed_suffix()`` carry a suffix proposer's latest responses from a
  running replica to one starting beside it (empty and 0 where the engine keeps none).
- ``check_health()`` raises :class:`EngineUnhealthyError` once the engine cannot serve.

Which backend a group runs is ``engine.backend`` (``native`` or ``vllm``). The native
engine steps in an engine core (``core.py``) in a process of its own (``ProcessClient``), or in a
thread of the replica's (``InprocClient``) where ``engine.core_process`` is off or the group is
tensor-parallel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Callable, Protocol

from cluster.hosting.protocol import ErrorInfo, GenerateDelta, GenerateRequest
from cluster.errors import NotFoundError, ParamError
from cluster.routing.stats import EngineLoad

if TYPE_CHECKING:
    from cluster.metrics.collector import MetricsSink


class EngineUnhealthyError(RuntimeError):
    """The engine cannot serve any more (a failed step, a dead rank or process)."""


@dataclass(frozen=True)
class SpecState:
    """The speculation in force.

    ``policy`` names where k comes from: ``none`` (no speculation), ``fixed``,
    ``table`` / ``adaptive`` (Tandem's controllers), ``batch-size-table`` (vLLM's
    ``num_speculative_tokens_per_batch_size``) or ``fixed-fallback`` (the table was asked
    for but the installed vLLM lacks it: k is fixed at ``num_speculative_tokens``).
    """

    method: str  # "none", "ngram", "draft", "suffix" or "eagle3"
    policy: str
    current_k: int
    k_table: dict[int, int]  # batch size -> k in force
    acceptance: float  # accepted / proposed draft tokens so far
    note: str = ""


@dataclass(frozen=True)
class BackendContext:
    """What the hosting process hands a backend: where metrics go and, for a tensor-parallel
    group served by a cluster, how to start the further ranks (``None``: local processes)."""

    metrics_sink: "MetricsSink | None" = None
    tp_launcher: Callable[[], object] | None = None


class EngineBackend(Protocol):
    name: str  # "native" or "vllm"
    max_model_len: int

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]: ...

    async def abort(self, request_id: str) -> None: ...

    def load(self, prefix_depth: int) -> EngineLoad: ...

    def capacity_tokens_per_second(self) -> float: ...

    def spec_state(self) -> SpecState: ...

    async def engine_stats(self) -> dict: ...

    async def step_timeline(self, last_seconds: float | None = None) -> dict: ...

    async def suffix_history(self, max_requests: int) -> list[list[int]]: ...

    async def seed_suffix(self, responses: list[list[int]]) -> int: ...

    def check_health(self) -> None: ...

    async def shutdown(self) -> None: ...


def input_error(err: ValueError) -> ErrorInfo:
    """The error a request gets for bad input: 404 for something it names that is not there
    (``NotFoundError``: an unknown adapter), else 400."""
    if isinstance(err, NotFoundError):
        return ErrorInfo(404, str(err), "not_found_error", err.param, "model_not_found")
    return ErrorInfo(400, str(err), param=error_param(err))


def error_param(err: BaseException) -> str | None:
    """The OpenAI parameter an engine's ValueError is about: a ``ParamError``'s field (Tandem's own
    errors), else (vLLM's) the parameter its message starts with or mentions."""
    if isinstance(err, ParamError):
        return err.param
    message = str(err)
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "logprobs", "min_tokens", "stop_token_ids",
                 "stop", "seed", "cache_salt"):
        if message.startswith(name):
            return name
    if "prompt" in message:
        return "prompt"
    return None
