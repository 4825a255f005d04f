"""``tandem bench prefix`` end to end on a tiny random Llama (no download, no timing assertions)."""

from __future__ import annotations

import json

import pytest

from cluster.bench.prefix import make_system_prompt, question, render
from cluster.cli import main
from cluster.models.loader import load_tokenizer, resolve_model
from cluster.models.tiny import save_tiny_model, save_tiny_tokenizer, tiny_llama_config

SMALL = ["--dtype", "float32", "--system-tokens", "128", "--warm-requests", "2", "--conversations", "2",
         "--turns", "2", "--chat-system-tokens", "64", "--output-len", "4", "--kv-cache-memory", "16MiB"]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model(tiny_llama_config(), folder)
    save_tiny_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def result(tiny_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "prefix.json"
    assert main(["bench", "prefix", "--model", str(tiny_folder), *SMALL, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_ttft_cold_and_warm(result):
    ttft = result["ttft"]
    kinds = [s["kind"] for s in ttft["samples"]]
    assert kinds == ["cold", "cold", "cold_first", "warm", "warm"]
    for s in ttft["samples"]:
        assert s["prompt_tokens"] > 128 and s["ttft_s"] > 0
        assert s["prefix_caching"] == (s["kind"] != "cold")
        if s["kind"] == "warm":
            assert s["cached_tokens"] >= 128 - result["settings"]["block_size"]
        else:
            assert s["cached_tokens"] == 0
    assert ttft["cold_median_s"] > 0 and ttft["warm_median_s"] > 0 and ttft["cold_over_warm"] > 0
    assert isinstance(ttft["meets_goal"], bool)


def test_multi_turn_on_vs_off(result):
    chat = result["multi_turn"]
    on, off = chat["runs"]
    assert (on["prefix_caching"], off["prefix_caching"]) == (True, False)
    for run in (on, off):
        assert run["output_tokens"] == 2 * 2 * 4 and run["tok_per_s"] > 0
    assert on["prompt_tokens"] == off["prompt_tokens"]
    assert chat["outputs_identical"] and chat["num_mismatched_turns"] == 0
    assert on["num_computed_tokens"] < off["num_computed_tokens"]
    assert on["prefix_cache_hits"] > 0 and 0 < on["prefix_cache_hit_rate"] <= 1
    assert off["prefix_cache_hits"] == 0
    assert chat["on_over_off_computed_tokens"] < 1


def test_settings_and_machine(result):
    assert result["settings"]["prompt_format"] == "plain"  # the tiny tokenizer has no chat template
    assert result["settings"]["system_tokens"] == 128 and result["settings"]["turns"] == 2
    assert result["machine"]["threads"] >= 1 and len(result["machine"]["load_average_1_5_15m"]) == 3


def test_system_prompt_is_exact_and_seeded(tiny_folder):
    tokenizer = load_tokenizer(resolve_model(str(tiny_folder)))
    text = make_system_prompt(tokenizer, 100, seed=0)
    assert len(tokenizer.encode(text, add_special_tokens=False)) == 100
    assert text == make_system_prompt(tokenizer, 100, seed=0) != make_system_prompt(tokenizer, 100, seed=1)


def test_plain_prompts_extend_the_history(tiny_folder):
    tokenizer = load_tokenizer(resolve_model(str(tiny_folder)))
    first = render(tokenizer, "sys", [], "q1")
    assert first == "System: sys\n\nUser: q1\n\nAssistant:"
    assert render(tokenizer, "sys", [("q1", " a1")], "q2").startswith(first)
    assert len({question(i) for i in range(100)}) == 100


def test_bad_sizes_are_rejected(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "prefix", "--turns", "0"])
    assert "argument --turns" in capsys.readouterr().err


def test_first_diff():
    from cluster.bench.prefix import _first_diff

    assert _first_diff([1, 2, 3], [1, 5, 3]) == 1 and _first_diff([1, 2], [1, 2, 3]) == 2
