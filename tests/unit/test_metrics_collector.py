"""The metric catalog and the collector that fills it from a live engine (no Ray).

The engine's own counters (``Engine.stats()``, ``SpecDecodeStats``) and the outputs
the consumers received are the reference: what the collector sends must add up to them.
"""

from __future__ import annotations

import time

import pytest

from cluster.hosting.core import EngineCore
from cluster.hosting.core_messages import AbortRequest, AddRequest
from cluster.hosting.protocol import GenerateRequest
from cluster.shared.sampling_params import SamplingParams
from cluster.metrics.catalog import METRICS, METRICS_BY_NAME, exported_series_names, markdown_table
from cluster.metrics.collector import EngineMetricsCollector, MemorySink
from tests.engine_helpers import make_engine

# The engine figures under vLLM's names (vllm/v1/metrics/loggers.py), and the two older names.
VLLM_NAMES = {
    "num_requests_running": "gauge", "num_requests_waiting": "gauge", "kv_cache_usage_perc": "gauge",
    "prefix_cache_queries": "counter", "prefix_cache_hits": "counter", "num_preemptions": "counter",
    "prompt_tokens": "counter", "generation_tokens": "counter", "request_success": "counter",
    "time_to_first_token_seconds": "histogram", "inter_token_latency_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram", "request_queue_time_seconds": "histogram",
    "spec_decode_num_drafts": "counter", "spec_decode_num_draft_tokens": "counter",
    "spec_decode_num_accepted_tokens": "counter", "spec_decode_num_accepted_tokens_per_pos": "counter",
    "request_time_per_output_token_seconds": "histogram", "request_inference_time_seconds": "histogram",
    "request_prefill_time_seconds": "histogram", "request_decode_time_seconds": "histogram",
    "request_prompt_tokens": "histogram", "request_generation_tokens": "histogram",
    "request_max_num_generation_tokens": "histogram", "request_params_max_tokens": "histogram",
    "request_params_n": "histogram", "request_num_preemptions": "histogram", "iteration_tokens_total": "histogram",
    "gpu_cache_usage_perc": "gauge", "time_per_output_token_seconds": "histogram", "lora_requests_info": "gauge",
}


def test_catalog_has_vllm_names_and_tandem_prefix_for_the_rest():
    assert len({m.name for m in METRICS}) == len(METRICS)
    for name, kind in VLLM_NAMES.items():
        assert METRICS_BY_NAME[name].kind == kind
    assert all(m.name.startswith("tandem_") for m in METRICS if m.name not in VLLM_NAMES)
    series = exported_series_names()
    assert "vllm:prefix_cache_hits_total" in series and "vllm:num_requests_running" in series
    assert "vllm:time_to_first_token_seconds_bucket" in series and "tandem:spec_k" in series
    table = markdown_table()
    assert all(f"`{m.prometheus_name}`" in table for m in METRICS)


def test_memory_sink_refuses_unknown_names_kinds_and_labels():
    sink = MemorySink()
    with pytest.raises(KeyError):
        sink.inc("generation_token", 1)  # a typo
    with pytest.raises(KeyError):
        sink.set("generation_tokens", 1)  # a counter, not a gauge
    with pytest.raises(KeyError):
        sink.inc("request_success", 1)  # missing finished_reason
    with pytest.raises(ValueError):
        sink.inc("generation_tokens", -1)


def _run(tiny_llama_dir, prompts, params, stop_after=None, **overrides):
    """Serve ``prompts`` through an engine core, stepped here; a request whose consumer stops after
    ``stop_after[i]`` tokens is aborted then. Returns the engine, the sink the core's samples were
    replayed into (as a replica does) and each request's tokens."""
    engine = make_engine(tiny_llama_dir, **overrides)
    core = EngineCore(engine)
    core.metrics = EngineMetricsCollector(engine, core.sink, poll_interval_s=0.0,
                                          capacity=lambda: float(engine.scheduler.num_running))
    sink = MemorySink()
    stops = stop_after or [None] * len(prompts)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for rid, prompt in zip(tokens, prompts):
        core.handle(AddRequest(GenerateRequest(rid, engine.tokenizer.encode(prompt), params)))
    live = set(tokens)
    while live:
        if engine.has_unfinished():
            assert core.step()
        message = core.take_message(time.monotonic())
        for rid, delta in message.deltas if message is not None else []:
            tokens[rid] += delta.token_ids
            if delta.finished:
                live.discard(rid)
        if message is not None and message.samples is not None:
            message.samples.replay(sink)
        for rid, stop in zip(tokens, stops):
            if stop is not None and rid in live and len(tokens[rid]) >= stop:
                core.handle(AbortRequest(rid))  # the consumer went away
                live.discard(rid)
    core.metrics.poll()
    samples = core.sink.drain()
    if samples is not None:
        samples.replay(sink)
    return engine, sink, list(tokens.values())


def test_counters_and_histograms_add_up_to_what_the_engine_did(tiny_llama_dir):
    prompts = ["the quick brown fox " * 3, "hello hello hello hello", "a b c d e f g", "one two one two one two"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine, sink, results = _run(tiny_llama_dir, prompts, params, method="draft", draft_model=str(tiny_llama_dir),
                                 num_speculative_tokens=3)
    num_tokens = sum(len(r) for r in results)
    assert num_tokens == 4 * 12
    assert sink.counter("generation_tokens") == num_tokens
    assert sink.counter("request_success", finished_reason="length") == 4
    assert sink.counter("request_success", finished_reason="abort") == 0
    tokenizer = engine.tokenizer
    assert sink.counter("prompt_tokens") == sum(len(tokenizer(p)["input_ids"]) for p in prompts)
    obs = sink.observations
    assert len(obs[("time_to_first_token_seconds", ())]) == 4
    assert len(obs[("request_queue_time_seconds", ())]) == 4
    assert len(obs[("e2e_request_latency_seconds", ())]) == 4
    # Every token after a request's first is one inter-token observation.
    assert len(obs[("inter_token_latency_seconds", ())]) == num_tokens - 4
    assert all(v >= 0 for values in obs.values() for v in values)
    assert max(obs[("e2e_request_latency_seconds", ())]) >= max(obs[("time_to_first_token_seconds", ())])
    # vLLM's per-request histograms: one observation per finished request, from its own figures.
    assert sorted(obs[("request_prompt_tokens", ())]) == sorted(len(tokenizer(p)["input_ids"]) for p in prompts)
    assert obs[("request_generation_tokens", ())] == [12] * 4
    assert obs[("request_params_max_tokens", ())] == [12] * 4 and obs[("request_params_n", ())] == [1] * 4
    assert obs[("request_num_preemptions", ())] == [0] * 4
    for name in ("request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds"):
        assert len(obs[(name, ())]) == 4, name
    for prefill, decode, inference in zip(obs[("request_prefill_time_seconds", ())],
                                          obs[("request_decode_time_seconds", ())],
                                          obs[("request_inference_time_seconds", ())]):
        assert abs(prefill + decode - inference) < 1e-6
    # One observation per engine step, of the tokens it computed: together all the engine computed.
    assert sum(obs[("iteration_tokens_total", ())]) == engine.stats().num_computed_tokens
    # Engine counters arrive whole, as increments.
    stats = engine.stats()
    assert sink.counter("prefix_cache_queries") == stats.prefix_cache_queries
    assert sink.counter("prefix_cache_hits") == stats.prefix_cache_hits
    spec = engine.spec_stats
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens == spec.num_draft_tokens  # self-draft
    assert sink.counter("spec_decode_num_drafts") == spec.num_drafts
    assert sink.counter("spec_decode_num_draft_tokens") == spec.num_draft_tokens
    assert sink.counter("spec_decode_num_accepted_tokens") == spec.num_accepted_tokens
    for position, accepted in enumerate(spec.accepted_per_position):
        assert sink.counter("spec_decode_num_accepted_tokens_per_pos", position=str(position)) == accepted
    assert sum(sink.counter("tandem_spec_steps", k=str(k)) for k in range(4)) == sum(spec.k_per_step.values())
    # Gauges show the idle engine and the controller's state.
    assert sink.gauges[("num_requests_running", ())] == 0
    assert sink.gauges[("kv_cache_usage_perc", ())] == 0
    assert sink.gauges[("tandem_spec_k", ())] == 3
    assert {dict(labels)["batch_size"] for name, labels in sink.gauges if name == "tandem_spec_k_table"} \
        == {"1", "2", "4", "8", "16", "32", "64"}  # up to max_num_seqs
    assert sink.gauges[("tandem_spec_acceptance_estimate", (("position", "0"),))] == 1.0
    assert sink.gauges[("tandem_capacity_tokens_per_second", ())] == 0.0  # the last poll's value, idle


def test_aborted_requests_are_counted_as_abort(tiny_llama_dir):
    prompts = ["the quick brown fox", "jumps over the lazy dog"]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine, sink, results = _run(tiny_llama_dir, prompts, params, stop_after=[3, None])
    assert len(results[1]) == 40
    assert sink.counter("request_success", finished_reason="abort") == 1
    assert sink.counter("request_success", finished_reason="length") == 1
    # Both prompts were computed (counted at their first token), the aborted one too.
    assert sink.counter("prompt_tokens") == sum(len(engine.tokenizer(p)["input_ids"]) for p in prompts)
    assert len(sink.observations[("e2e_request_latency_seconds", ())]) == 2
    assert sink.gauges[("num_requests_running", ())] == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.pool.num_blocks
    # No speculation configured: no speculation series at all.
    assert not [name for name, _ in sink.counters if name.startswith(("spec_decode", "tandem_spec"))]


def test_the_metrics_doc_lists_every_metric_as_the_catalog_does():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    assert markdown_table() in doc, "docs/metrics.md's metric table is out of date: paste markdown_table() into it"


def test_suffix_trees_on_the_metrics(tiny_llama_dir):
    pytest.importorskip("arctic_inference", reason="arctic-inference is built by `make install`")
    engine = make_engine(tiny_llama_dir, num_blocks=64, method="suffix", num_speculative_tokens=4,
                         suffix_decoding_max_cached_requests=2)
    sink = MemorySink()
    collector = EngineMetricsCollector(engine, sink)
    for i in range(4):
        engine.add_request([5, 6, 7, 8, 5, 6, 7, 8][: 4 + i], SamplingParams(max_tokens=12, ignore_eos=True))
    while engine.has_unfinished():
        collector.on_step(engine.step())
    collector.poll()
    tree = engine.proposer.tree_stats
    assert sink.gauges[("tandem_suffix_tree_requests", ())] == 2  # the cap
    assert sink.gauges[("tandem_suffix_tree_tokens", ())] == 24  # two responses of 12 tokens
    assert sink.gauges[("tandem_suffix_tree_prompts", ())] == 0
    assert sink.counters[("tandem_suffix_tree_evictions", ())] == tree.num_evicted_requests == 2
    speculations = {labels[0][1]: n for (name, labels), n in sink.counters.items()
                    if name == "tandem_suffix_speculations"}
    assert set(speculations) == set(tree.match_len_ranges())
    assert sum(speculations.values()) == sum(tree.match_len_counts) > 0
