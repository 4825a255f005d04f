"""The registry each process keeps and the page ``GET /metrics`` makes of several of them, read
back with prometheus_client's own parser (the format's reference implementation in Python)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.metrics.catalog import METRICS, SOURCE_LABELS
from cluster.metrics.exposition import merge
from cluster.metrics.prometheus_sink import PrometheusSink

FIXED = {"model_name": "tiny", "group": "fast", "device_kind": "cpu"}


def _series(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def test_a_replica_registry_shows_every_unlabelled_series_from_the_start():
    series = _series(PrometheusSink("replica", FIXED).exposition())
    for spec in METRICS:
        if spec.source == "replica" and not spec.labels:
            for name in spec.prometheus_names:
                assert name in series, name
                assert all(s.labels.items() >= FIXED.items() for s in series[name])
    assert series["vllm:prompt_tokens_total"][0].value == 0
    assert not any(name.endswith("_created") for name in series)


def test_older_names_repeat_what_their_successors_record():
    sink = PrometheusSink("replica", FIXED)
    sink.set("kv_cache_usage_perc", 0.25)
    for value in (0.02, 0.3, 0.3):
        sink.observe("inter_token_latency_seconds", value)
    series = _series(sink.exposition())
    assert series["vllm:gpu_cache_usage_perc"][0].value == series["vllm:kv_cache_usage_perc"][0].value == 0.25
    old = {s.labels["le"]: s.value for s in series["vllm:time_per_output_token_seconds_bucket"]}
    new = {s.labels["le"]: s.value for s in series["vllm:inter_token_latency_seconds_bucket"]}
    assert old == new and new["0.025"] == 1 and new["+Inf"] == 3


def test_the_merged_page_keeps_each_source_apart_and_each_family_once():
    first, second = PrometheusSink("replica", FIXED), PrometheusSink("replica", FIXED)
    first.inc("request_success", 2, (("finished_reason", "stop"),))
    second.inc("request_success", 5, (("finished_reason", "stop"),))
    ingress = PrometheusSink("ingress")
    ingress.inc("tandem_router_decisions", 3, (("group", "fast"),))
    sources = [({"application": "app", "deployment": "fast", "replica": "r1"}, first.exposition()),
               ({"application": "app", "deployment": "fast", "replica": "r2"}, second.exposition()),
               ({"application": "app", "deployment": "Ingress", "replica": "i1"}, ingress.exposition()),
               ({"application": "app", "deployment": "fast", "replica": "broken"}, "vllm:x{le=")]
    page = merge(sources)
    helps = [line.split()[2] for line in page.splitlines() if line.startswith("# HELP")]
    assert len(helps) == len(set(helps))  # one family per name, whatever the number of sources
    series = _series(page)
    stop = {s.labels["replica"]: s.value for s in series["vllm:request_success_total"]}
    assert stop == {"r1": 2, "r2": 5}
    assert all(set(SOURCE_LABELS) <= set(s.labels) for samples in series.values() for s in samples)
    assert [(s.labels["group"], s.labels["replica"], s.value) for s in series["tandem:router_decisions_total"]] \
        == [("fast", "i1", 3)]
    assert "broken" not in page  # a page that does not parse is left out, the others are served


def test_a_sink_refuses_a_missing_fixed_label():
    with pytest.raises(ValueError, match="device_kind"):
        PrometheusSink("replica", {"model_name": "tiny", "group": "fast"})


def test_lora_info_keeps_only_the_latest_adapter_lists():
    sink = PrometheusSink("replica", FIXED)
    sink.set("lora_requests_info", 100.0, (("max_lora", "2"), ("running_lora_adapters", "a"),
                                           ("waiting_lora_adapters", "")))
    sink.set("lora_requests_info", 101.0, (("max_lora", "2"), ("running_lora_adapters", "a,b"),
                                           ("waiting_lora_adapters", "c")))
    [sample] = _series(sink.exposition())["vllm:lora_requests_info"]
    assert sample.value == 101.0 and sample.labels["running_lora_adapters"] == "a,b"
    assert sample.labels["waiting_lora_adapters"] == "c" and sample.labels["max_lora"] == "2"


def test_suffix_match_length_series_show_from_the_start_on_any_replica():
    """A vLLM group's replica never runs the native collector: its sink alone must show the
    match-length series, as the native group's does (tests/vllm/test_same_statistics.py)."""
    from cluster.metrics.catalog import COMMON_LABELS
    from cluster.metrics.prometheus_sink import PrometheusSink
    from cluster.spec_decode.suffix_stats import SuffixTreeStats

    text = PrometheusSink("replica", {k: "x" for k in COMMON_LABELS}).exposition()
    shown = [line for line in text.splitlines() if line.startswith("tandem:suffix_speculations_total{")]
    assert len(shown) == len(SuffixTreeStats.match_len_ranges()) and all(line.endswith(" 0.0") for line in shown)
