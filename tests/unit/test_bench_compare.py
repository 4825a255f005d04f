"""``tandem bench compare``'s pure parts: the ratios, the derived Tandem configs, the table."""

from __future__ import annotations

from pathlib import Path

import yaml

from cluster.bench.compare import LATENCY_KEYS, THROUGHPUT_KEYS, print_report, ratios
from cluster.bench.compare_servers import tandem_config_yaml
from cluster.config import load_config


def test_ratios_are_first_over_second_and_none_when_missing():
    a = {"mean_ttft_ms": 50.0, "output_throughput": 30.0, "p99_itl_ms": None}
    b = {"mean_ttft_ms": 100.0, "output_throughput": 20.0, "p99_itl_ms": 5.0}
    r = ratios(a, b)
    assert set(r) == set(LATENCY_KEYS + THROUGHPUT_KEYS)
    assert r["mean_ttft_ms"] == 0.5 and r["output_throughput"] == 1.5
    assert r["p99_itl_ms"] is None and r["mean_e2el_ms"] is None


def test_derived_configs_keep_the_profile_and_swap_speculation_and_groups(tmp_path):
    source = tmp_path / "source" / "ngram.yaml"  # local.yaml with the n-gram profile its comment names
    source.parent.mkdir()
    source.write_text(Path("configs/local.yaml").read_text().replace("# profile: ", "profile: ")
                      .replace("method: suffix", "method: ngram"))
    on, port = tandem_config_yaml(source, True, None, tmp_path)
    config = load_config(on)
    assert config.serve.port == port and config.speculative.method == "ngram"
    profile = source.parent / "profiles" / "cpu-2core-avx512-smollm2-135m-ngram-capped-bf16.json"
    assert config.speculative.profile == str(profile)  # absolute: found beside the source, not the copy
    groups = [{"name": "native", "num_cpus": 1}, {"name": "vllm", "num_cpus": 1, "engine": "vllm"}]
    off, _ = tandem_config_yaml("configs/local.yaml", False, groups, tmp_path)
    config = load_config(off)
    assert config.speculative.method == "none"
    assert [g.name for g in config.serve.groups] == ["native", "vllm"]
    assert config.serve.groups[1].engine == {"backend": "vllm"}
    assert yaml.safe_load(off.read_text())["serve"]["groups"][1]["engine"] == "vllm"


def test_report_prints_a_table_per_pair():
    from rich.console import Console

    summary = {key: 1.0 for key in LATENCY_KEYS + THROUGHPUT_KEYS}
    report = {"groups": {"systems": {"group-native": summary, "group-vllm": summary},
                         "pairs": {"native/vllm (one cluster)": ("group-native", "group-vllm")},
                         "ratios": {"native/vllm (one cluster)": ratios(summary, summary)}}}
    console = Console(record=True, width=120)
    print_report(console, report)
    text = console.export_text()
    assert "native/vllm" in text and "mean_ttft_ms" in text and "1.00" in text
