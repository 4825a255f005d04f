"""Target and draft pairs of chosen shapes (``cluster/bench/proportions.py``) and ``tandem bench
paper --proportions`` on the tiny pair (no download, no timing assertions)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig

from cluster.bench.proportions import FIRST_TEXT_ID, PAIRS, build_pair, random_prompt_ids
from cluster.cli import main
from cluster.models.loader import load_tokenizer, resolve_model


def test_every_pair_describes_real_configs_and_the_paper_pair_is_the_papers():
    for pair in PAIRS.values():
        for shape in (pair.target, pair.draft):
            config = shape.hf_config()
            assert config.hidden_size == shape.hidden_size and config.num_hidden_layers == shape.num_layers
        assert pair.target.vocab_size == pair.draft.vocab_size  # a draft model must share the vocabulary
        assert pair.target.num_parameters() > pair.draft.num_parameters()
    paper = PAIRS["paper"]
    # OPT-6.7B and OPT-125M: published sizes, embeddings aside.
    assert paper.target.num_parameters() == pytest.approx(6.65e9, rel=0.01)
    assert paper.draft.num_parameters() == pytest.approx(123.5e6, rel=0.01)


def test_a_pair_is_written_once_with_its_shapes_and_a_tokenizer(tmp_path):
    pair = PAIRS["tiny"]
    folders = build_pair(pair, tmp_path)
    for shape, folder in ((pair.target, folders.target), (pair.draft, folders.draft)):
        config = AutoConfig.from_pretrained(folder)
        assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.num_key_value_heads,
                config.vocab_size) == (shape.hidden_size, shape.intermediate_size, shape.num_layers,
                                       shape.num_kv_heads, shape.vocab_size)
        assert len(load_tokenizer(resolve_model(str(folder)))) == shape.vocab_size
    stamp = (folders.target / "config.json").stat().st_mtime_ns
    assert build_pair(pair, tmp_path) == folders
    assert (folders.target / "config.json").stat().st_mtime_ns == stamp  # reused, not rewritten
    assert not list(folders.target.parent.glob("*.partial"))


def test_random_prompts_have_the_length_and_avoid_the_special_ids():
    prompts = random_prompt_ids(256, 5, 40, seed=1)
    assert len(prompts) == 5 and all(len(p) == 40 for p in prompts)
    assert all(FIRST_TEXT_ID <= t < 256 for p in prompts for t in p)
    assert prompts == random_prompt_ids(256, 5, 40, seed=1) and prompts != random_prompt_ids(256, 5, 40, seed=2)


def test_proportions_need_synthetic_acceptance(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    assert main(["bench", "paper", "--proportions", "tiny", "--json", str(tmp_path / "p.json")]) == 2
    assert "--synthetic-acceptance" in capsys.readouterr().err
    assert not (tmp_path / "bench" / "proportions").exists()  # refused before anything is built


def test_paper_on_the_tiny_pair_times_the_draft_model_with_drawn_acceptance(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    out = tmp_path / "paper.json"
    code = main(["bench", "paper", "--proportions", "tiny", "--synthetic-acceptance", "0.8", "--prompt-len", "24",
                 "--batch-sizes", "1,2", "--ks", "0,2", "--max-k", "2", "--output-len", "8", "--requests", "2",
                 "--rates", "40", "--max-num-seqs", "4", "--kv-cache-memory", "16MiB", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    settings = result["settings"]
    assert settings["method"] == "draft" and settings["dtype"] == "float32" and settings["prompts"] == "random"
    assert settings["proportions"]["name"] == "tiny" and settings["proportions"]["target"]["num_layers"] == 2
    assert settings["synthetic_acceptance"] == "synthetic acceptance α = 0.8"
    assert set(settings["prompt_lens"]) == {24}
    # The profile timed the draft model's passes beside the target's.
    assert result["profile"]["draft_grid"] and result["profile"]["target_grid"]
    drafted = [c for c in result["tpot_vs_k"]["cells"] if c["k"] == 2 and c["acceptance_rate"] is not None]
    assert drafted and all(0.0 < c["acceptance_rate"] < 1.0 for c in drafted)  # drawn, not all or nothing
    printed = capsys.readouterr().out
    assert "Pass times, ms, of the tiny pair" in printed and "tiny pair" in printed
