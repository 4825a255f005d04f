"""vLLM's per-step statistics turned into Tandem's: the router's load and the catalog's series.

vLLM hands a stat logger ``record(scheduler_stats, iteration_stats)`` after every batch
of engine outputs (``vllm.v1.metrics``). :class:`VllmStatsRecorder` reads the fields by
name (no vLLM import here, so it is tested with plain stand-ins) and:

- keeps the router's figures: running / waiting requests, KV usage, speculation counters
  and a ``StepTimeTracker`` fed with the time between two consecutive steps;
- writes the series of ``cluster/metrics/catalog.py`` to a ``MetricsSink`` under the same
  names and labels as the native engine's collector.

Where vLLM's definitions differ from ours: its inter-token latency is one sample per
streamed output (a speculative step that yields 3 tokens is one sample), where the native
collector divides that interval among the tokens; and TTFT, E2E and queue time are
measured by vLLM from the request's arrival at its front-end (in the replica).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from cluster.metrics.collector import MetricsSink, lora_info_labels
from cluster.routing.step_times import StepTimeTracker

_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort", "error": "abort", "repetition": "stop"}


def _labels(**values: object) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, str(v)) for k, v in values.items()))


@dataclass
class SpecCounters:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)

    def add_step(self, spec) -> None:
        """Adds one step's ``SpecDecodingStats`` (vLLM's, read by field name)."""
        self.num_drafts += spec.num_drafts
        self.num_draft_tokens += spec.num_draft_tokens
        self.num_accepted_tokens += spec.num_accepted_tokens
        for counts, step in ((self.accepted_per_position, spec.num_accepted_tokens_per_pos),
                             (self.drafted_per_position, spec.num_draft_tokens_per_pos)):
            counts.extend([0] * (len(step) - len(counts)))
            for j, n in enumerate(step):
                counts[j] += n

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def conditional_acceptance(self) -> list[float]:
        """Per position j: P(draft j accepted | drafts before it accepted). vLLM counts a
        draft at j only when one was proposed there; j is reached when j - 1 was accepted."""
        reached = [d if j == 0 else min(d, self.accepted_per_position[j - 1])
                   for j, d in enumerate(self.drafted_per_position)]
        return [a / r if r else 0.0 for a, r in zip(self.accepted_per_position, reached)]


class VllmStatsRecorder:
    def __init__(self, sink: MetricsSink | None, k_for_batch: Callable[[int], int], k_table: dict[int, int],
                 step_times: StepTimeTracker, speculating: bool,
                 capacity: Callable[[], float] | None = None) -> None:
        self.sink = sink
        self.k_for_batch = k_for_batch  # the k vLLM runs at a batch size (its schedule, or fixed)
        self.k_table = k_table
        self.step_times = step_times
        self.speculating = speculating
        self.capacity = capacity
        self.max_loras: int | None = None  # set when vLLM serves LoRA adapters
        # called with (batch, k, seconds, prompt tokens, its SpecDecodingStats or None) after each timed step
        self.on_step: Callable[[int, int, float, int, object], None] | None = None
        self.num_running = 0
        self.num_waiting = 0
        self.kv_cache_usage = 0.0
        self.current_k = 0
        self.spec = SpecCounters()
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_preemptions = 0
        self._last_step: float | None = None
        if sink is not None:
            self._start_series()

    def _start_series(self) -> None:
        """Counters exist from 0, as the native collector's do after its first poll."""
        names = ["prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens"]
        if self.speculating:
            names += ["spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"]
        for name in names:
            self.sink.inc(name, 0.0)
        self.poll()

    # ---- called by vLLM's stat-logger hook, once per engine step --------------------------
    def record(self, scheduler_stats, iteration_stats, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if scheduler_stats is not None:
            self._scheduler(scheduler_stats, iteration_stats, now)
        if iteration_stats is not None:
            self._iteration(iteration_stats)
        self.poll()

    def _scheduler(self, stats, iteration_stats, now: float) -> None:
        was_running = self.num_running
        self.num_running = int(stats.num_running_reqs)
        self.num_waiting = int(stats.num_waiting_reqs) + int(getattr(stats, "num_skipped_waiting_reqs", 0))
        self.kv_cache_usage = float(stats.kv_cache_usage)
        batch = max(self.num_running, was_running)
        self.current_k = self.k_for_batch(max(1, batch)) if self.speculating else 0
        spec = getattr(stats, "spec_decoding_stats", None)
        if self._last_step is not None and batch > 0:
            prefill = 0 if iteration_stats is None else int(iteration_stats.num_prompt_tokens)
            self.step_times.observe(batch, self.current_k, prefill, now - self._last_step)
            if self.on_step is not None:
                self.on_step(batch, self.current_k, now - self._last_step, prefill, spec)
        self._last_step = now if batch > 0 or self.num_waiting > 0 else None
        cache = getattr(stats, "prefix_cache_stats", None)
        if cache is not None and not getattr(cache, "reset", False):
            self._inc("prefix_cache_queries", cache.queries)
            self._inc("prefix_cache_hits", cache.hits)
            self.prefix_cache_queries += cache.queries
            self.prefix_cache_hits += cache.hits
        if self.max_loras is not None and self.sink is not None:
            running, waiting = set(stats.running_lora_adapters), set(stats.waiting_lora_adapters)
            self.sink.set("lora_requests_info", time.time(), lora_info_labels(self.max_loras, running, waiting))
        if spec is not None:
            self._spec_step(spec)
        if self.speculating and batch > 0:
            self._inc("tandem_spec_steps", 1, _labels(k=self.current_k))

    def _spec_step(self, spec) -> None:
        self.spec.add_step(spec)
        self._inc("spec_decode_num_drafts", spec.num_drafts)
        self._inc("spec_decode_num_draft_tokens", spec.num_draft_tokens)
        self._inc("spec_decode_num_accepted_tokens", spec.num_accepted_tokens)
        for j, n in enumerate(spec.num_accepted_tokens_per_pos):
            self._inc("spec_decode_num_accepted_tokens_per_pos", n, _labels(position=j))

    def _iteration(self, it) -> None:
        self._inc("prompt_tokens", it.num_prompt_tokens)
        self._inc("generation_tokens", it.num_generation_tokens)
        self.num_preemptions += it.num_preempted_reqs
        self._inc("num_preemptions", it.num_preempted_reqs)
        if self.sink is None:
            return
        for ttft in it.time_to_first_tokens_iter:
            self.sink.observe("time_to_first_token_seconds", ttft)
        for itl in it.inter_token_latencies_iter:
            self.sink.observe("inter_token_latency_seconds", itl)
        self.sink.observe("iteration_tokens_total", it.num_prompt_tokens + it.num_generation_tokens)
        for n in it.n_params_iter:
            self.sink.observe("request_params_n", n)
        for most in it.max_num_generation_tokens_iter:
            self.sink.observe("request_max_num_generation_tokens", most)
        for done in it.finished_requests:
            self._finished(done)

    def _finished(self, done) -> None:
        """vLLM's per-request figures of a finished request (its FinishedRequestStats)."""
        reason = _FINISH_REASONS.get(str(done.finish_reason), "stop")
        self.sink.inc("request_success", 1, _labels(finished_reason=reason))
        for name, value in (("e2e_request_latency_seconds", done.e2e_latency),
                            ("request_queue_time_seconds", done.queued_time),
                            ("request_prefill_time_seconds", done.prefill_time),
                            ("request_inference_time_seconds", done.inference_time),
                            ("request_decode_time_seconds", done.decode_time),
                            ("request_prompt_tokens", done.num_prompt_tokens),
                            ("request_generation_tokens", done.num_generation_tokens),
                            ("request_num_preemptions", done.num_preemptions)):
            self.sink.observe(name, value)
        if done.num_generation_tokens > 1:
            self.sink.observe("request_time_per_output_token_seconds", done.mean_time_per_output_token)
        if done.max_tokens_param is not None:
            self.sink.observe("request_params_max_tokens", done.max_tokens_param)

    def submitted(self, now: float | None = None) -> None:
        """A request was handed to vLLM: an idle engine's next step starts now."""
        if self._last_step is None:
            self._last_step = time.monotonic() if now is None else now

    def idle(self) -> None:
        """No request is left in the engine: vLLM sends no further step to say so."""
        self.num_running = self.num_waiting = 0
        self.kv_cache_usage = 0.0
        self._last_step = None
        self.poll()

    # ---- gauges ----------------------------------------------------------------------------
    def poll(self) -> None:
        if self.sink is None:
            return
        self.sink.set("num_requests_running", self.num_running)
        self.sink.set("num_requests_waiting", self.num_waiting)
        self.sink.set("kv_cache_usage_perc", self.kv_cache_usage)
        if self.capacity is not None:
            self.sink.set("tandem_capacity_tokens_per_second", self.capacity())
        if not self.speculating:
            return
        self.sink.set("tandem_spec_k", self.current_k)
        for b, k in self.k_table.items():
            self.sink.set("tandem_spec_k_table", k, _labels(batch_size=b))
        for j, value in enumerate(self.spec.conditional_acceptance):
            self.sink.set("tandem_spec_acceptance_estimate", value, _labels(position=j))

    def _inc(self, name: str, value: float, labels: tuple = ()) -> None:
        if self.sink is not None and value > 0:
            self.sink.inc(name, value, labels)
