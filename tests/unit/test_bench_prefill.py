"""``tandem bench prefill`` end to end on a tiny random Llama with head_dim 64 (no timing assertions)."""

from __future__ import annotations

import json

import pytest

from cluster.cli import main
from cluster.kernels import build
from cluster.models.tiny import save_tiny_model, save_tiny_tokenizer, tiny_llama_config

SMALL = ["--cases", "0+70,40+50", "--rounds", "2", "--kv-cache-memory", "16MiB", "--max-num-batched-tokens", "64"]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-64")
    save_tiny_model(tiny_llama_config(hidden_size=128, num_attention_heads=2, num_key_value_heads=1), folder)
    save_tiny_tokenizer(folder)
    return folder


def _run(folder, tmp_path, *extra) -> dict:
    out = tmp_path / "prefill.json"
    assert main(["bench", "prefill", "--model", str(folder), *SMALL, *extra, "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_both_paths_time_every_case_in_bfloat16(tiny_folder, tmp_path, monkeypatch, kv_dtype):
    kernel = build.prefill_attention()
    if kernel is None:
        pytest.skip("prefill_attention needs AVX-512")
    # The engine attaches the kernel where its probe finds it faster; here it is attached regardless.
    monkeypatch.setattr("cluster.models.layers.cpu_ops.prefill_kernel_for", lambda *shape: kernel)
    result = _run(tiny_folder, tmp_path, "--dtype", "bfloat16", "--kv-cache-dtype", kv_dtype)
    assert result["kernel_attached"] and result["dtype"] == "bfloat16" and result["run"]["benchmark"] == "prefill"
    assert result["kv_cache_dtype"] == kv_dtype
    assert [(c["cached_tokens"], c["new_tokens"]) for c in result["cases"]] == [(0, 70), (40, 50)]
    for case in result["cases"]:
        assert len(case["sdpa_ms"]) == len(case["kernel_ms"]) == 2
        assert case["sdpa_best_ms"] == min(case["sdpa_ms"]) and case["kernel_best_ms"] == min(case["kernel_ms"])
        assert case["sdpa_over_kernel"] == pytest.approx(case["sdpa_best_ms"] / case["kernel_best_ms"], rel=1e-2)


def test_float32_measures_sdpa_alone_and_says_why(tiny_folder, tmp_path, capsys):
    result = _run(tiny_folder, tmp_path, "--dtype", "float32")
    assert not result["kernel_attached"]
    assert all("kernel_ms" not in case and len(case["sdpa_ms"]) == 2 for case in result["cases"])
    assert "SDPA only" in capsys.readouterr().out


def test_bad_cases_are_rejected(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "prefill", "--cases", "0+128,12"])
    assert "cached + new tokens" in capsys.readouterr().err
