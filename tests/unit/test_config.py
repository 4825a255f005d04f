from pathlib import Path

import pytest

from cluster.config import ConfigError, TandemConfig, load_config, parse_size, with_overrides

ROOT = Path(__file__).resolve().parents[2]


def test_local_yaml_loads():
    config = load_config(ROOT / "configs" / "local.yaml")
    assert config.model.model == "smollm2-135m-instruct"
    assert config.cache.block_size == 16


def test_unknown_key_is_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("scheduler:\n  max_num_seqs: 4\n  max_num_seqz: 8\n")
    with pytest.raises(ConfigError, match="scheduler.max_num_seqz"):
        load_config(path)


def test_wrong_type_is_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("cache:\n  block_size: sixteen\n")
    with pytest.raises(ConfigError, match="cache.block_size"):
        load_config(path)


def test_unknown_section_and_bad_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("modle:\n  dtype: float32\n")
    with pytest.raises(ConfigError, match="modle"):
        load_config(path)
    path.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="YAML"):
        load_config(path)


def test_overrides_route_to_sections():
    config = with_overrides(TandemConfig(), dtype="bfloat16", max_num_seqs=3, block_size=8)
    assert (config.model.dtype, config.scheduler.max_num_seqs, config.cache.block_size) == ("bfloat16", 3, 8)
    with pytest.raises(ConfigError, match="unknown setting 'max_seqs'"):
        with_overrides(TandemConfig(), max_seqs=3)
    with pytest.raises(ConfigError, match="dtype"):
        with_overrides(TandemConfig(), dtype="int3")


def test_sizes():
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("2GB") == 2 * 10**9
    assert parse_size(1024) == 1024
    with pytest.raises(ConfigError):
        parse_size("lots")


def test_local_yaml_ships_suffix_drafts_and_its_ngram_profile_is_found_next_to_it(tmp_path):
    config = load_config(ROOT / "configs" / "local.yaml")
    assert config.speculative.method == "suffix" and config.speculative.controller == "adaptive"
    assert config.speculative.profile is None  # the built-in prior, calibrated online
    # the n-gram profile its comment names, uncommented in a copy elsewhere: read next to the copy
    text = (ROOT / "configs" / "local.yaml").read_text().replace("# profile: ", "profile: ")
    (tmp_path / "profiles").mkdir()
    name = "cpu-2core-avx512-smollm2-135m-ngram-capped-bf16.json"
    (tmp_path / "profiles" / name).write_bytes((ROOT / "configs" / "profiles" / name).read_bytes())
    (tmp_path / "local.yaml").write_text(text.replace("method: suffix", "method: ngram"))
    config = load_config(tmp_path / "local.yaml")
    assert config.speculative.method == "ngram" and Path(config.speculative.profile) == tmp_path / "profiles" / name


def test_ngram_draft_cap_reaches_the_proposer():
    from cluster.spec_decode.factory import build_speculation

    proposer, _ = build_speculation(with_overrides(TandemConfig(), method="ngram"), None)
    assert proposer.ngram.draft_per_match_token == 1.0  # the default caps short matches
    proposer, _ = build_speculation(with_overrides(TandemConfig(), method="ngram", ngram_draft_per_match_token=None),
                                    None)
    assert proposer.ngram.draft_per_match_token is None  # every match drafts k, as vLLM
    with pytest.raises(ConfigError, match="speculative.ngram_draft_per_match_token"):
        with_overrides(TandemConfig(), method="ngram", ngram_draft_per_match_token=-1)
