"""Turns one engine's statistics into the samples of ``catalog.METRICS``.

The collector is fed by the engine loop (``hosting/core.py``): ``on_step`` with each
step's outputs, ``on_abort`` when a running request is aborted, and ``poll`` for the
gauges and the engine's cumulative counters (sent as increments since the last poll).
It writes to a ``MetricsSink``; ``MemorySink`` keeps the samples for tests, and
``PrometheusSink`` the registry a replica serves (``prometheus_sink.py``). No Ray and no torch here.

Timings are taken with ``time.monotonic()``, the clock of ``RequestTimes``:
- TTFT and E2E run from the request's arrival at this engine, queue time from
  arrival to its first scheduling;
- inter-token latency: the time between two outputs of a request, divided among the
  tokens the later one carries (a step that accepts 3 draft tokens plus one yields 4
  tokens of a quarter of the interval each).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Callable, Protocol

from cluster.metrics.catalog import METRICS_BY_NAME
from cluster.spec_decode.latency_model import power_of_two_sizes

if TYPE_CHECKING:
    from cluster.shared.outputs import RequestOutput

Labels = tuple[tuple[str, str], ...]


class EngineReadings(Protocol):
    """What the collector reads of an engine (``cluster.engine.engine.Engine`` has it): its config,
    its latest step's record (``k``), its controller (None without speculation), its speculation
    counters and ``stats()``."""

    config: Any
    last_step: Any
    controller: Any
    spec_stats: Any

    def stats(self) -> Any: ...


class MetricsSink(Protocol):
    def inc(self, name: str, value: float, labels: Labels = ()) -> None: ...

    def set(self, name: str, value: float, labels: Labels = ()) -> None: ...

    def observe(self, name: str, value: float, labels: Labels = ()) -> None: ...


class MemorySink:
    """Keeps what it is sent: counter totals, last gauge values, every observation."""

    def __init__(self) -> None:
        self.counters: dict[tuple[str, Labels], float] = defaultdict(float)
        self.gauges: dict[tuple[str, Labels], float] = {}
        self.observations: dict[tuple[str, Labels], list[float]] = defaultdict(list)

    def inc(self, name: str, value: float, labels: Labels = ()) -> None:
        _check(name, "counter", labels)
        if value < 0:
            raise ValueError(f"counter {name} cannot go down (got {value})")
        self.counters[(name, labels)] += value

    def set(self, name: str, value: float, labels: Labels = ()) -> None:
        _check(name, "gauge", labels)
        self.gauges[(name, labels)] = value

    def observe(self, name: str, value: float, labels: Labels = ()) -> None:
        _check(name, "histogram", labels)
        self.observations[(name, labels)].append(value)

    def counter(self, name: str, **labels: str) -> float:
        return self.counters.get((name, tuple(sorted(labels.items()))), 0.0)


def _check(name: str, kind: str, labels: Labels) -> None:
    spec = METRICS_BY_NAME.get(name)
    if spec is None or spec.kind != kind:
        raise KeyError(f"{name} is not a {kind} of the catalog")
    if {k for k, _ in labels} != set(spec.labels):
        raise KeyError(f"{name} takes labels {spec.labels}, got {labels}")


def _labels(**values: object) -> Labels:
    return tuple(sorted((k, str(v)) for k, v in values.items()))


def lora_info_labels(max_loras: int, running: set[str], waiting: set[str]) -> Labels:
    """The labels of ``lora_requests_info``, as vLLM writes them (names joined by commas)."""
    return _labels(max_lora=max_loras, running_lora_adapters=",".join(sorted(running)),
                   waiting_lora_adapters=",".join(sorted(waiting)))


class EngineMetricsCollector:
    def __init__(self, engine: EngineReadings, sink: MetricsSink, poll_interval_s: float = 1.0,
                 capacity: Callable[[], float] | None = None) -> None:
        self.engine = engine
        self.sink = sink
        self.capacity = capacity  # the replica's predicted peak tokens/s, when it knows one
        self.poll_interval_s = poll_interval_s
        self._last_output_time: dict[str, float] = {}  # request id -> time of its latest tokens
        self._arrival: dict[str, float] = {}
        self._totals: dict[tuple[str, Labels], float] = {}  # engine counters at the last poll
        self._last_poll = float("-inf")
        self._batch_sizes = power_of_two_sizes(engine.config.scheduler.max_num_seqs)

    # ---- fed by the engine loop ---------------------------------------------------------
    def on_step(self, outputs: list[RequestOutput], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        record = self.engine.last_step
        if record is not None:
            self.sink.observe("iteration_tokens_total", record.num_tokens)
            if self.engine.controller is not None:
                self.sink.inc("tandem_spec_steps", 1, _labels(k=record.k))
        for out in outputs:
            self._on_output(out, now)
        if now - self._last_poll >= self.poll_interval_s:
            self.poll(now)

    def on_abort(self, request_id: str, now: float | None = None) -> None:
        """A request still in the engine was aborted (its caller went away)."""
        now = time.monotonic() if now is None else now
        arrival = self._arrival.pop(request_id, None)
        self._last_output_time.pop(request_id, None)
        self.sink.inc("request_success", 1, _labels(finished_reason="abort"))
        if arrival is not None:
            self.sink.observe("e2e_request_latency_seconds", now - arrival)

    def _on_output(self, out: RequestOutput, now: float) -> None:
        rid, times = out.request_id, out.times
        num_new = len(out.outputs[0].delta_token_ids)
        if times is not None:
            self._arrival.setdefault(rid, times.arrival_time)
        if num_new:
            self.sink.inc("generation_tokens", num_new)
            last = self._last_output_time.get(rid)
            if last is None:  # the first token: the prompt has been computed
                self.sink.inc("prompt_tokens", len(out.prompt_token_ids))
                if times is not None:
                    first = times.first_token_time if times.first_token_time is not None else now
                    self.sink.observe("time_to_first_token_seconds", first - times.arrival_time)
                    if times.scheduled_time is not None:
                        self.sink.observe("request_queue_time_seconds", times.scheduled_time - times.arrival_time)
            else:
                for _ in range(num_new):
                    self.sink.observe("inter_token_latency_seconds", (now - last) / num_new)
            self._last_output_time[rid] = now
        if out.finished:
            self._last_output_time.pop(rid, None)
            arrival = self._arrival.pop(rid, None)
            reason = out.outputs[0].finish_reason or "stop"
            self.sink.inc("request_success", 1, _labels(finished_reason=reason))
            if arrival is not None:
                self.sink.observe("e2e_request_latency_seconds", now - arrival)
            self._on_finished(out, now)

    def _on_finished(self, out: RequestOutput, now: float) -> None:
        """The per-request histograms vLLM keeps, observed when a request ends."""
        generated = out.usage.completion_tokens
        self.sink.observe("request_prompt_tokens", out.usage.prompt_tokens)
        self.sink.observe("request_generation_tokens", generated)
        self.sink.observe("request_params_n", 1)
        self.sink.observe("request_num_preemptions", out.num_preemptions)
        if out.max_tokens is not None:
            self.sink.observe("request_params_max_tokens", out.max_tokens)
            self.sink.observe("request_max_num_generation_tokens", out.max_tokens)
        times = out.times
        if times is None or times.scheduled_time is None:
            return
        self.sink.observe("request_inference_time_seconds", now - times.scheduled_time)
        if times.first_token_time is not None:
            self.sink.observe("request_prefill_time_seconds", times.first_token_time - times.scheduled_time)
            self.sink.observe("request_decode_time_seconds", now - times.first_token_time)
            if generated > 1:
                self.sink.observe("request_time_per_output_token_seconds",
                                  (now - times.first_token_time) / (generated - 1))

    # ---- gauges and cumulative counters -------------------------------------------------
    def poll(self, now: float | None = None) -> None:
        self._last_poll = time.monotonic() if now is None else now
        engine = self.engine
        stats = engine.stats()
        self.sink.set("num_requests_running", stats.num_running)
        self.sink.set("num_requests_waiting", stats.num_waiting)
        self.sink.set("kv_cache_usage_perc", stats.kv_cache_usage)
        if self.capacity is not None:
            self.sink.set("tandem_capacity_tokens_per_second", self.capacity())
        self._advance("prefix_cache_queries", stats.prefix_cache_queries)
        self._advance("prefix_cache_hits", stats.prefix_cache_hits)
        self._advance("num_preemptions", stats.num_preemptions)
        if engine.worker.runner.lora is not None:
            adapters = engine.adapters
            self.sink.set("tandem_lora_adapters_loaded", len(adapters.loaded))
            self.sink.set("tandem_lora_requests_waiting", len(adapters.waiting) + adapters.num_reading)
            self._advance("tandem_lora_adapter_loads", adapters.num_loads)
            scheduler = engine.scheduler
            running = {r.lora_name for r in scheduler.running if r.lora_name}
            waiting = {r.lora_name for r in scheduler.waiting if r.lora_name}
            waiting |= {request.lora_name for request, _ in adapters.waiting}
            self.sink.set("lora_requests_info", time.time(), lora_info_labels(
                engine.config.model.max_loras, running, waiting))
        controller = engine.controller
        if controller is None:
            return
        spec = engine.spec_stats
        self._advance("spec_decode_num_drafts", spec.num_drafts)
        self._advance("spec_decode_num_draft_tokens", spec.num_draft_tokens)
        self._advance("spec_decode_num_accepted_tokens", spec.num_accepted_tokens)
        for position, accepted in enumerate(spec.accepted_per_position):
            self._advance("spec_decode_num_accepted_tokens_per_pos", accepted, _labels(position=position))
        self.sink.set("tandem_spec_k", spec.current_k)
        for b, k in controller.k_table(self._batch_sizes).items():
            self.sink.set("tandem_spec_k_table", k, _labels(batch_size=b))
        estimate = getattr(controller, "acceptance", None) or spec.effective_acceptance
        for position, value in enumerate(estimate):
            self.sink.set("tandem_spec_acceptance_estimate", value, _labels(position=position))
        tree = getattr(engine.proposer, "tree_stats", None)
        if tree is not None:
            self._poll_suffix_tree(tree)

    def _poll_suffix_tree(self, tree) -> None:
        """A suffix proposer's trees (``cluster.spec_decode.suffix_stats.SuffixTreeStats``)."""
        self.sink.set("tandem_suffix_tree_requests", tree.num_cached_requests)
        self.sink.set("tandem_suffix_tree_tokens", tree.num_cached_tokens)
        self.sink.set("tandem_suffix_tree_prompts", tree.num_active_requests)
        self._advance("tandem_suffix_tree_evictions", tree.num_evicted_requests)
        for name, count in zip(tree.match_len_ranges(), tree.match_len_counts):
            self._advance("tandem_suffix_speculations", count, _labels(match_len=name))

    def _advance(self, name: str, total: float, labels: Labels = ()) -> None:
        """Send the growth of an engine counter since the last poll."""
        key = (name, labels)
        if key not in self._totals:  # first poll: the series exists from the start, at 0
            self.sink.inc(name, 0.0, labels)
            self._totals[key] = 0.0
        if total > self._totals[key]:
            self.sink.inc(name, total - self._totals[key], labels)
            self._totals[key] = total
