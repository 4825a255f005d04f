"""The vLLM adapter's pure parts (no vLLM needed): engine arguments from our config, the
speculation plan, the group config syntax, and vLLM's step statistics turned into ours."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from cluster.backends.vllm_args import vllm_settings
from cluster.backends.vllm_stats import VllmStatsRecorder
from cluster.config import ConfigError, config_from_dict, group_engine_config
from cluster.spec_decode.controller import BatchState, TableController
from cluster.spec_decode.profile_data import batch_size_ranges
from cluster.metrics.collector import MemorySink
from cluster.routing.step_times import StepTimeTracker


def test_group_engine_picks_the_backend_in_both_spellings():
    config = config_from_dict({"serve": {"groups": [
        {"name": "a"}, {"name": "b", "engine": "vllm"},
        {"name": "c", "engine": {"backend": "vllm", "max_num_seqs": 8}},
    ]}})
    assert group_engine_config(config, "a").engine.backend == "native"
    assert group_engine_config(config, "b").engine.backend == "vllm"
    c = group_engine_config(config, "c")
    assert (c.engine.backend, c.scheduler.max_num_seqs) == ("vllm", 8)


def test_unknown_backend_is_an_error_naming_the_key():
    with pytest.raises(ConfigError, match="engine.*native or vllm"):
        config_from_dict({"serve": {"groups": [{"engine": "sglang"}]}})
    with pytest.raises(ConfigError, match="backend"):
        config_from_dict({"serve": {"groups": [{"engine": {"backend": "sglang"}}]}})


def _k_from_ranges(ranges: list[list[int]], batch_size: int) -> int:
    """k for a batch size as vLLM reads its ranges: the range holding it, past the last the last k."""
    held = [k for start, end, k in ranges if start <= batch_size <= end]
    return held[0] if held else ranges[-1][2]


@pytest.mark.parametrize("table", [{1: 4, 4: 3, 16: 1}, {8: 2}, {2: 5, 3: 4, 64: 0}, {1: 1}])
def test_vllms_ranges_give_every_batch_size_the_k_the_native_table_picks(table):
    ranges = batch_size_ranges(table)
    assert ranges[0][0] == 1 and all(a[1] < b[0] for a, b in zip(ranges, ranges[1:]))  # from 1, in order
    native = TableController(table)
    for batch_size in range(1, 100):
        assert _k_from_ranges(ranges, batch_size) == native.choose_k(BatchState(batch_size, 0)), batch_size
    assert batch_size_ranges({1: 4, 4: 3, 16: 1}) == [[1, 3, 4], [4, 15, 3], [16, 16, 1]]


def _config(**spec):
    return config_from_dict({"model": {"max_model_len": 512}, "cache": {"kv_cache_memory": "64MiB"},
                             "scheduler": {"max_num_seqs": 16}, "speculative": spec,
                             "engine": {"vllm_args": {"enforce_eager": True}}})


def test_ngram_with_a_table_becomes_vllms_batch_size_schedule(tmp_path):
    config = _config(method="ngram", num_speculative_tokens=5, ngram_min=2, ngram_max=3, controller="table",
                     profile=str(tmp_path / "p.json"))
    s = vllm_settings(config, 1, "/m", None, {1: 5, 4: 3, 16: 1}, has_batch_size_schedule=True)
    args = s.engine_args
    assert args["model"] == "/m" and args["max_model_len"] == 512 and args["max_num_seqs"] == 16
    assert args["kv_cache_memory_bytes"] == 64 * 2**20 and args["enforce_eager"] is True
    assert args["speculative_config"] == {
        "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 3,
        "num_speculative_tokens_per_batch_size": [[1, 3, 5], [4, 15, 3], [16, 16, 1]]}
    assert s.spec.policy == "batch-size-table"
    json.dumps(args)  # plain values only


def test_without_the_schedule_option_k_is_fixed_and_said_so(tmp_path):
    config = _config(method="ngram", num_speculative_tokens=5, controller="adaptive", profile=str(tmp_path / "p"))
    s = vllm_settings(config, 1, "/m", None, {1: 5, 16: 1}, has_batch_size_schedule=False)
    assert s.spec.policy == "fixed-fallback" and "no num_speculative_tokens_per_batch_size" in s.spec.note
    assert s.engine_args["speculative_config"]["num_speculative_tokens"] == 5
    assert "num_speculative_tokens_per_batch_size" not in s.engine_args["speculative_config"]


def test_draft_model_and_no_speculation():
    draft = vllm_settings(_config(method="draft", draft_model="/d", num_speculative_tokens=3), 2, "/m", "/d",
                          None, True)
    assert draft.engine_args["speculative_config"] == {"method": "draft_model", "model": "/d",
                                                       "num_speculative_tokens": 3}
    assert draft.engine_args["tensor_parallel_size"] == 2 and draft.spec.policy == "fixed"
    head = vllm_settings(_config(method="eagle3", draft_model="/h", num_speculative_tokens=3), 1, "/m", "/h",
                         None, True)
    assert head.engine_args["speculative_config"] == {"method": "eagle3", "model": "/h", "num_speculative_tokens": 3}
    plain = vllm_settings(_config(), 1, "/m", None, None, True)
    assert "speculative_config" not in plain.engine_args and plain.spec.policy == "none"


def test_lora_adapters_enable_vllms_lora_for_all_of_them_at_once():
    config = config_from_dict({"model": {"lora_modules": {"a": "/a", "b": "/b"}, "max_lora_rank": 32},
                               "engine": {"backend": "vllm"}, "parallel": {"tensor_parallel_size": 2}})
    args = vllm_settings(config, 2, "/m", None, None, True).engine_args
    assert (args["enable_lora"], args["max_loras"], args["max_lora_rank"]) == (True, 2, 32)
    assert "enable_lora" not in vllm_settings(_config(), 1, "/m", None, None, True).engine_args
    with pytest.raises(ConfigError, match="tensor_parallel_size must be 1"):  # the native engine: one process
        config_from_dict({"model": {"lora_modules": {"a": "/a"}}, "parallel": {"tensor_parallel_size": 2}})


def _step(running, waiting, usage, spec=None, cache=(0, 0)):
    return SimpleNamespace(num_running_reqs=running, num_waiting_reqs=waiting, num_skipped_waiting_reqs=0,
                           kv_cache_usage=usage, spec_decoding_stats=spec,
                           prefix_cache_stats=SimpleNamespace(reset=False, queries=cache[0], hits=cache[1]))


def _iteration(prompt=0, generated=0, ttft=(), itl=(), finished=(), n=(), most=()):
    """The fields of vLLM 0.32's IterationStats that the recorder reads."""
    return SimpleNamespace(num_prompt_tokens=prompt, num_generation_tokens=generated, num_preempted_reqs=0,
                           time_to_first_tokens_iter=list(ttft), inter_token_latencies_iter=list(itl),
                           finished_requests=list(finished), n_params_iter=list(n),
                           max_num_generation_tokens_iter=list(most))


def test_vllm_step_stats_feed_the_router_and_the_catalog_series():
    sink = MemorySink()
    recorder = VllmStatsRecorder(sink, lambda b: 3 if b <= 2 else 1, {1: 3, 2: 3, 4: 1}, StepTimeTracker(), True)
    spec = SimpleNamespace(num_drafts=2, num_draft_tokens=6, num_accepted_tokens=3,
                           num_accepted_tokens_per_pos=[2, 1, 0], num_draft_tokens_per_pos=[2, 2, 2])
    recorder.record(_step(2, 1, 0.25, cache=(32, 16)),
                    _iteration(prompt=32, generated=2, ttft=[0.1, 0.2], n=[1, 1], most=[8, 8]), now=1.0)
    recorder.record(_step(2, 0, 0.3, spec=spec), _iteration(generated=8, itl=[0.05, 0.05]), now=1.1)
    # vLLM 0.32's FinishedRequestStats fields
    done = SimpleNamespace(finish_reason="length", e2e_latency=0.5, queued_time=0.01, prefill_time=0.1,
                           inference_time=0.45, decode_time=0.35, num_prompt_tokens=16, num_generation_tokens=5,
                           num_preemptions=0, max_tokens_param=5, mean_time_per_output_token=0.0875)
    recorder.record(_step(0, 0, 0.0), _iteration(finished=[done]), now=1.2)
    assert (recorder.num_running, recorder.num_waiting, recorder.kv_cache_usage) == (0, 0, 0.0)
    assert recorder.spec.acceptance_rate == 0.5
    assert recorder.spec.conditional_acceptance == [1.0, 0.5, 0.0]
    assert recorder.step_times.curve(3, 4)  # decode steps were timed
    assert sink.counter("prompt_tokens") == 32 and sink.counter("generation_tokens") == 10
    assert sink.counter("prefix_cache_queries") == 32 and sink.counter("prefix_cache_hits") == 16
    assert sink.counter("spec_decode_num_draft_tokens") == 6 and sink.counter("spec_decode_num_accepted_tokens") == 3
    assert sink.counter("spec_decode_num_accepted_tokens_per_pos", position="1") == 1
    assert sink.counter("request_success", finished_reason="length") == 1
    assert sink.counter("tandem_spec_steps", k="3") == 3  # the finishing step ran with 2
    assert sink.observations[("time_to_first_token_seconds", ())] == [0.1, 0.2]
    obs = sink.observations
    assert obs[("iteration_tokens_total", ())] == [34, 8, 0]
    assert obs[("request_params_n", ())] == [1, 1] and obs[("request_max_num_generation_tokens", ())] == [8, 8]
    assert obs[("request_prefill_time_seconds", ())] == [0.1] and obs[("request_decode_time_seconds", ())] == [0.35]
    assert obs[("request_prompt_tokens", ())] == [16] and obs[("request_generation_tokens", ())] == [5]
    assert obs[("request_time_per_output_token_seconds", ())] == [0.0875]
    assert obs[("request_params_max_tokens", ())] == [5]
    assert sink.gauges[("tandem_spec_k_table", (("batch_size", "4"),))] == 1
    assert sink.gauges[("num_requests_running", ())] == 0


def test_tandems_own_int8_schemes_are_refused_for_vllm():
    config = config_from_dict({"model": {"quantization": "int8"}})
    with pytest.raises(ValueError, match="model.quantization='int8'.*engine.vllm_args"):
        vllm_settings(config, 1, "/m", None, None, True)
    config = config_from_dict({"cache": {"kv_cache_dtype": "int8"}})
    with pytest.raises(ValueError, match="cache.kv_cache_dtype"):
        vllm_settings(config, 1, "/m", None, None, True)
    passed = config_from_dict({"engine": {"vllm_args": {"quantization": "fp8"}}})
    assert vllm_settings(passed, 1, "/m", None, None, True).engine_args["quantization"] == "fp8"


def test_suffix_passes_vllms_own_keys():
    config = _config(method="suffix", num_speculative_tokens=8, suffix_decoding_max_tree_depth=32,
                     suffix_decoding_min_token_prob=0.2)
    s = vllm_settings(config, 1, "/m", None, None, has_batch_size_schedule=False)
    assert s.engine_args["speculative_config"] == {
        "method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 32,
        "suffix_decoding_max_cached_requests": 10000, "suffix_decoding_max_spec_factor": 1.0,
        "suffix_decoding_min_token_prob": 0.2}


@pytest.mark.parametrize("threads, cores, preset, expected", [
    (1, {0, 1}, None, "nobind"),  # a replica of one thread beside others: the OS places its threads
    (2, {0, 1}, None, None),  # the whole host: vLLM's own binding
    (1, {0, 1}, "0", "0"),  # the operator's choice stays
])
def test_replicas_sharing_a_host_leave_thread_placement_to_the_os(monkeypatch, threads, cores, preset, expected):
    import torch

    from cluster.backends.vllm import use_device_threads

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: cores)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    monkeypatch.setenv("OMP_NUM_THREADS", "9")
    if preset is None:
        monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    else:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", preset)
    use_device_threads(config_from_dict({"device": {"device": "cpu", "num_threads": threads}}))
    import os

    assert os.environ["OMP_NUM_THREADS"] == str(threads)
    assert os.environ.get("VLLM_CPU_OMP_THREADS_BIND") == expected
