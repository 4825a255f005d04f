"""Memory planning: shapes against transformers, the KV pool against the engine's, refusals with their numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from transformers import AutoModelForCausalLM

from cluster.cli import main
from cluster.config import ConfigError, config_from_dict, load_config
from cluster.models.tiny import save_tiny_model, save_tiny_tokenizer, tiny_llama_config
from cluster.planning.memory_plan import check_memory, plan_memory
from cluster.planning.model_shapes import model_shape
from tests.engine_helpers import make_engine

ROOT = Path(__file__).resolve().parents[2]
HETERO = ROOT / "configs" / "hetero-gpu.yaml"


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("untied")
    save_tiny_model(tiny_llama_config(tie_word_embeddings=False, num_hidden_layers=3), path)
    save_tiny_tokenizer(path)
    return path


@pytest.mark.parametrize("folder", ["tiny_llama_dir", "untied_dir"])
def test_parameter_count_of_a_folder_is_transformers_own(folder, request):
    path = request.getfixturevalue(folder)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model_shape(str(path)).num_params == sum(p.numel() for p in model.parameters())


def test_known_models_have_their_published_sizes():
    assert model_shape("/models/Meta-Llama-3.1-8B-Instruct").num_params == 8_030_261_248
    assert model_shape("/models/Llama-3.2-1B-Instruct").num_params == 1_235_814_400
    assert model_shape("smollm2-135m-instruct").num_params == 134_515_008
    assert model_shape("/models/some-unknown-model") is None


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_kv_tokens_and_weights_match_the_engine(untied_dir, kv_cache_dtype):
    settings = dict(kv_cache_memory="3MiB", block_size=8, dtype="float32", kv_cache_dtype=kv_cache_dtype)
    engine = make_engine(untied_dir, **settings)
    plan = plan_memory(engine.config)[0]
    assert plan.kv_tokens == engine.block_manager.pool.num_blocks * 8
    model = engine.worker.runner.model
    rank = plan.ranks[0]
    assert rank.kv_cache == engine.block_manager.pool.num_blocks * engine.worker.runner.spec.bytes_per_block
    hf_bytes = 4 * sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(untied_dir).parameters())
    assert rank.target_weights == hf_bytes
    assert model.vocab_size == model_shape(str(untied_dir)).vocab_size


def _hetero(**h100_engine) -> dict:
    data = yaml.safe_load(HETERO.read_text())
    data["serve"]["groups"][0]["engine"].update(h100_engine)
    return data


def test_a_group_too_big_for_its_gpu_is_refused_with_its_numbers_and_the_fix():
    with pytest.raises(ConfigError) as err:
        check_memory(config_from_dict(_hetero(kv_cache_memory="100GiB"), "hetero"))
    message = str(err.value)
    assert "serve.groups[h100] does not fit one H100 (79.65 GiB)" in message
    assert "KV cache 100.00 GiB" in message and "draft KV cache 50.00 GiB" in message
    assert "kv_cache_memory (a budget per rank) to at most" in message
    plans = {p.group: p for p in plan_memory(config_from_dict(_hetero(kv_cache_memory="100GiB"), "hetero"))}
    # tensor parallel: the target is split over the ranks, the draft and its cache live on rank 0
    h100 = plans["h100"]
    assert [r.rank for r in h100.ranks] == [0, 1]
    assert h100.ranks[1].draft_weights == 0 and h100.ranks[0].draft_weights > 0
    assert h100.ranks[0].target_weights == h100.ranks[1].target_weights
    assert plans["a10g"].problem is None


def test_weights_alone_too_big_name_the_other_fixes():
    data = _hetero()
    data["serve"]["groups"][1]["engine"] = {"quantization": "none", "kv_cache_memory": "1MiB"}
    data["model"]["dtype"] = "float32"
    with pytest.raises(ConfigError, match=r"serve.groups\[a10g\].*the weights alone do not fit"):
        check_memory(config_from_dict(data, "hetero"))


def test_kv_cache_fraction_is_reported_per_rank():
    data = _hetero()
    del data["serve"]["groups"][0]["engine"]["kv_cache_memory"]
    data["cache"]["kv_cache_memory"] = None  # the shared default (512MiB) would win over the fraction
    h100 = plan_memory(config_from_dict(data, "hetero"))[0]
    assert any("kv_cache_fraction 0.3" in note and "per rank" in note for note in h100.notes)
    assert h100.kv_tokens > 0


def test_unknown_kinds_and_models_are_noted_not_refused():
    data = _hetero()
    data["serve"]["groups"][0]["device_kind"] = "TPU-v9"
    data["model"]["model"] = "/models/mystery"
    plans = plan_memory(config_from_dict(data, "hetero"))
    assert all(p.problem is None for p in plans)
    assert any("TPU-v9" in note for note in plans[0].notes)
    assert any("/models/mystery" in note for note in plans[0].notes)


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_shipped_configs_fit(name):
    for plan in check_memory(load_config(ROOT / "configs" / name)):
        assert plan.problem is None


def test_cli_check_and_k8s_render_refuse(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_hetero(kv_cache_memory="100GiB")))
    assert main(["config", "check", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "REFUSED: serve.groups[h100]" in out and "h100          1" in out
    assert main(["config", "check", str(HETERO)]) == 0
    assert main(["k8s", "render", str(bad), "--out", str(tmp_path / "k8s")]) == 2
    assert "does not fit one H100" in capsys.readouterr().err
    assert not (tmp_path / "k8s").exists()
