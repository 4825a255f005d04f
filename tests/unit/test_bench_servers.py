"""The servers ``tandem bench served`` starts: the Tandem configs derived from the one given."""

from __future__ import annotations

from pathlib import Path

import yaml

from cluster.bench.servers import free_port, tandem_config_yaml
from cluster.config import load_config


def test_derived_configs_keep_the_profile_and_swap_speculation(tmp_path):
    source = tmp_path / "source" / "ngram.yaml"  # local.yaml with the n-gram profile its comment names
    source.parent.mkdir()
    source.write_text(Path("configs/local.yaml").read_text().replace("# profile: ", "profile: ")
                      .replace("method: suffix", "method: ngram"))
    on, port = tandem_config_yaml(source, True, tmp_path)
    config = load_config(on)
    assert config.serve.port == port and config.speculative.method == "ngram"
    assert config.serve.host == "127.0.0.1" and len({port, config.serve.proxy_port}) == 2
    profile = source.parent / "profiles" / "cpu-2core-avx512-smollm2-135m-ngram-capped-bf16.json"
    assert config.speculative.profile == str(profile)  # absolute: found beside the source, not the copy
    off, _ = tandem_config_yaml("configs/vllm-group.yaml", False, tmp_path)
    config = load_config(off)
    assert config.speculative.method == "none"
    assert [g.name for g in config.serve.groups] == ["native", "vllm"]  # the groups stay as written
    assert Path(config.serve.groups[1].profile).is_absolute()
    assert yaml.safe_load(off.read_text())["serve"]["groups"][1]["engine"] == "vllm"
    assert 0 < free_port() < 65536
