"""Memory planning: shapes against transformers, the KV pool against the engine's, refusals with their numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from cluster.cli import main
from cluster.config import ConfigError, config_from_dict, load_config
from cluster.kernels import packed_linear
from cluster.kernels.build import small_gemm
from cluster.kernels.packed_linear import PackedLinear, can_pack
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


def _bytes_held(model) -> int:
    """The engine model's weights in memory: parameters, buffers (packed copies) and the plain
    weights PackedLinear keeps, each tensor once; not the rotary tables."""
    tensors = {id(t): t for name, t in [*model.named_parameters(), *model.named_buffers()]
               if t is not None and not name.startswith("rotary.")}
    tensors.update({id(m.plain_weight): m.plain_weight for m in model.modules()
                    if isinstance(m, PackedLinear) and m.plain_weight is not None})
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("dtype, kv_cache_dtype, float32_rows, batch_invariant", [
    ("float32", "auto", None, False),
    ("float32", "int8", None, False),
    ("bfloat16", "auto", None, False),
    ("bfloat16", "auto", 16, False),  # a CPU where bfloat16 layers keep widening_gemm's copy
    ("bfloat16", "auto", 16, True),  # small_gemm's copy alone
])
def test_kv_tokens_and_weights_match_the_engine(untied_dir, monkeypatch, dtype, kv_cache_dtype, float32_rows,
                                                batch_invariant):
    if dtype == "bfloat16" and not can_pack(torch.device("cpu"), torch.bfloat16):
        pytest.skip("oneDNN packs no bfloat16 weights on this CPU")
    if batch_invariant and small_gemm() is None:
        pytest.skip("batch-invariant layers need the compiled small_gemm kernel")
    monkeypatch.setattr(packed_linear, "float32_gemm_min_rows", lambda: float32_rows)
    settings = dict(kv_cache_memory="3MiB", block_size=8, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                    batch_invariant=batch_invariant)
    engine = make_engine(untied_dir, **settings)
    plan = plan_memory(engine.config)[0]
    assert plan.kv_tokens == engine.block_manager.pool.num_blocks * 8
    model = engine.worker.runner.model
    rank = plan.ranks[0]
    assert rank.kv_cache == engine.block_manager.pool.num_blocks * engine.worker.runner.spec.bytes_per_block
    assert rank.target_weights == _bytes_held(model)
    has_copy = any(isinstance(m, PackedLinear) and m.widened_weight is not None for m in model.modules())
    assert has_copy == (dtype == "bfloat16" and float32_rows is not None and not batch_invariant)
    assert model.vocab_size == model_shape(str(untied_dir)).vocab_size


def _hetero(**h100_engine) -> dict:
    data = yaml.safe_load(HETERO.read_text())
    data["serve"]["groups"][0]["engine"].update(h100_engine)
    return data


def test_a_group_too_big_for_its_gpu_is_refused_with_its_numbers_and_the_fix():
    native = _hetero(kv_cache_memory="100GiB", backend="native")
    with pytest.raises(ConfigError) as err:
        check_memory(config_from_dict(native, "hetero"))
    message = str(err.value)
    assert "serve.groups[h100] does not fit one H100 (79.65 GiB)" in message
    assert "KV cache 100.00 GiB" in message and "draft KV cache 50.00 GiB" in message
    assert "kv_cache_memory (a budget per rank) to at most" in message
    plans = {p.group: p for p in plan_memory(config_from_dict(native, "hetero"))}
    # tensor parallel: the target is split over the ranks, the draft and its cache live on rank 0
    h100 = plans["h100"]
    assert [r.rank for r in h100.ranks] == [0, 1]
    assert h100.ranks[1].draft_weights == 0 and h100.ranks[0].draft_weights > 0
    assert h100.ranks[0].target_weights == h100.ranks[1].target_weights
    assert plans["a10g"].problem is None


def test_a_vllm_group_shares_its_kv_budget_with_the_draft_and_splits_the_draft_over_the_ranks():
    with pytest.raises(ConfigError) as err:
        check_memory(config_from_dict(_hetero(kv_cache_memory="100GiB"), "hetero"))
    message = str(err.value)
    assert "serve.groups[h100] does not fit one H100 (79.65 GiB)" in message
    # One pool of 100 GiB per rank for both models' layers, 64 KiB a token for the target's half of
    # the KV heads and 16 KiB for the draft's: 80 + 20 GiB, and the whole room left is the budget.
    assert "KV cache 80.00 GiB" in message and "draft KV cache 20.00 GiB" in message
    assert "kv_cache_memory (a budget per rank) to at most 66.12 GiB" in message
    h100 = plan_memory(config_from_dict(_hetero(), "hetero"))[0]
    assert h100.backend == "vllm"
    assert h100.ranks[0].draft_weights == h100.ranks[1].draft_weights > 0
    assert h100.ranks[0].draft_kv_cache == h100.ranks[1].draft_kv_cache > 0
    whole = plan_memory(config_from_dict(_hetero(backend="native"), "hetero"))[0].ranks[0].draft_weights
    assert 2 * h100.ranks[0].draft_weights - whole == 33 * 2048 * 2  # split in two; its 33 norms whole on each rank
    assert h100.kv_tokens == 40 * 2**30 // ((64 + 16) * 1024 * 16) * 16


def test_vllm_fp8_counts_one_byte_per_linear_weight_and_keeps_the_vocabulary_in_the_dtype():
    a10g = {p.group: p for p in plan_memory(load_config(HETERO))}["a10g"]
    assert (a10g.backend, a10g.quantization) == ("vllm", "fp8")
    # Llama 3.1 8B: 8,030,261,248 parameters, of which two 128256 x 4096 tables (embedding and the
    # untied head, bfloat16) and 65 norms of 4096 (bfloat16); the rest are linear, one byte each.
    vocab, norms = 2 * 128256 * 4096, 65 * 4096
    assert a10g.ranks[0].target_weights == (8_030_261_248 - vocab - norms) + 2 * (vocab + norms)
    # 6 GiB for 128 KiB (target) + 32 KiB (draft) a token, in blocks of 16 tokens
    assert a10g.kv_tokens == 6 * 2**30 // (160 * 1024 * 16) * 16 == 39_312
    data = yaml.safe_load(HETERO.read_text())
    data["serve"]["groups"][1]["engine"]["vllm_args"] = {"quantization": "awq"}
    awq = plan_memory(config_from_dict(data, "hetero"))[1]
    assert awq.ranks[0].target_weights == 2 * 8_030_261_248  # not modelled: counted in bfloat16
    assert any("'awq' is not modelled" in note for note in awq.notes)


def test_weights_alone_too_big_name_the_other_fixes():
    data = _hetero()
    data["serve"]["groups"][1]["engine"] = {"quantization": "none", "kv_cache_memory": "1MiB"}
    data["model"]["dtype"] = "float32"
    with pytest.raises(ConfigError, match=r"serve.groups\[a10g\].*the weights alone do not fit.*model.quantization"):
        check_memory(config_from_dict(data, "hetero"))
    data["serve"]["groups"][1]["engine"] = {"backend": "vllm", "kv_cache_memory": "1MiB"}
    with pytest.raises(ConfigError, match=r"the weights alone do not fit.*engine.vllm_args.quantization: fp8"):
        check_memory(config_from_dict(data, "hetero"))


def test_kv_cache_fraction_is_reported_per_rank():
    data = _hetero(backend="native")
    del data["serve"]["groups"][0]["engine"]["kv_cache_memory"]
    data["cache"]["kv_cache_memory"] = None  # the shared default (512MiB) would win over the fraction
    h100 = plan_memory(config_from_dict(data, "hetero"))[0]
    assert any("kv_cache_fraction 0.3" in note and "per rank" in note for note in h100.notes)
    assert h100.kv_tokens > 0


def test_without_a_budget_a_vllm_group_fills_its_gpu_memory_utilization():
    data = _hetero()
    del data["serve"]["groups"][0]["engine"]["kv_cache_memory"]
    data["cache"]["kv_cache_memory"] = None
    data["serve"]["groups"][0]["engine"]["vllm_args"] = {"gpu_memory_utilization": 0.8}
    h100 = plan_memory(config_from_dict(data, "hetero"))[0]
    assert any("gpu_memory_utilization 0.8 of one H100" in note for note in h100.notes)
    block = (64 + 16) * 1024 * 16
    assert 0.8 * h100.device_bytes - block < h100.ranks[0].total <= 0.8 * h100.device_bytes


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


def test_the_native_engine_is_one_line_away_in_the_shipped_gpu_configs():
    """What the configs' comments promise: `engine: native` (and, on the A10G, Tandem's int8 in place
    of vLLM's fp8) still fits every group."""
    single = yaml.safe_load((ROOT / "configs" / "gpu-single.yaml").read_text())
    assert single["serve"]["groups"][0]["engine"] == "vllm"
    single["serve"]["groups"][0]["engine"] = "native"
    hetero = _hetero(backend="native")
    a10g = hetero["serve"]["groups"][1]["engine"]
    del a10g["vllm_args"]
    a10g.update(backend="native", quantization="int8")
    for data in (single, hetero):
        plans = check_memory(config_from_dict(data, "native"))
        assert [p.backend for p in plans] == ["native"] * len(plans)


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


def test_lora_adapters_are_counted_at_the_size_the_engine_holds_them(tiny_llama_dir, tmp_path):
    """Two PEFT adapters (every projection at rank 4; q and v at rank 8): the plan's LoRA bytes are
    the engine's stacked A and B, and PEFT's saved tensors, to the byte; an adapter not readable
    here is counted at max_lora_rank on every projection, and said so."""
    from safetensors.torch import load_file

    from cluster.models.lora import LoRALinear
    from tests.lora_helpers import save_peft_adapter

    adapters = {"all": str(save_peft_adapter(tiny_llama_dir, tmp_path / "all", seed=1)),
                "qv": str(save_peft_adapter(tiny_llama_dir, tmp_path / "qv", seed=2, targets=["q_proj", "v_proj"],
                                            rank=8))}
    engine = make_engine(tiny_llama_dir, dtype="float32", num_blocks=16, lora_modules=adapters)
    plan = plan_memory(engine.config)[0]
    held = sum(t.numel() * t.element_size() for m in engine.worker.runner.model.modules() if isinstance(m, LoRALinear)
               for part in m.parts if part.a is not None for t in (part.a, part.bt))
    saved = sum(t.numel() * 4 for path in adapters.values()
                for t in load_file(str(Path(path) / "adapter_model.safetensors")).values())
    assert plan.ranks[0].lora == held == saved > 0
    assert any(n.startswith("LoRA: 2 adapters, each at its own rank and targets") for n in plan.notes)

    shape = model_shape(str(tiny_llama_dir))
    missing = config_from_dict({"model": {"model": str(tiny_llama_dir), "dtype": "float32", "max_lora_rank": 8,
                                          "lora_modules": {"elsewhere": str(tmp_path / "not-here")}},
                                "cache": {"num_blocks": 16}})
    plan = plan_memory(missing)[0]
    # in + out of the seven projections: q, k, v, o, gate, up, down each read or write the hidden size once
    per_layer = 8 * (7 * shape.hidden_size + 3 * shape.intermediate_size + 2 * shape.num_heads * shape.head_dim
                     + 2 * shape.num_kv_heads * shape.head_dim)
    assert plan.ranks[0].lora == 4 * per_layer * shape.num_layers
    assert any("elsewhere not readable here" in n for n in plan.notes)
    # A lora_dir: the rest of max_loras at max_lora_rank on every projection, beside the one above.
    on_demand = config_from_dict({"model": {**missing.model.model_dump(), "lora_dir": str(tmp_path), "max_loras": 3},
                                  "cache": {"num_blocks": 16}})
    plan = plan_memory(on_demand)[0]
    assert plan.ranks[0].lora == 3 * 4 * per_layer * shape.num_layers
    assert any("room for 2 from model.lora_dir at max_lora_rank 8" in n for n in plan.notes)


def test_vllm_groups_count_lora_buffers_for_every_adapter_at_max_rank():
    """SmolLM2-135M, two adapters, max_lora_rank 16, bfloat16: 2 x 16 x 10,176 values a layer
    (the seven projections' in + out), 30 layers; halved where tensor parallelism splits them."""
    def plan(tp: int):
        data = {"model": {"model": "smollm2-135m-instruct", "dtype": "bfloat16", "max_lora_rank": 16,
                          "lora_modules": {"a": "/adapters/a", "b": "/adapters/b"}},
                "engine": {"backend": "vllm"}, "cache": {"num_blocks": 64},
                "parallel": {"tensor_parallel_size": tp},
                "serve": {"groups": [{"name": "g", "device_kind": "H100", "tensor_parallel_size": tp}]}}
        return plan_memory(config_from_dict(data))[0]

    assert plan(1).ranks[0].lora == 2 * 16 * 10_176 * 30 * 2
    column, row = 576 + 576 + 2 * (576 + 192) + 2 * (576 + 1536), 576 + 576 + 1536 + 576  # in + out
    split = 16 * (576 + 576 // 2 + 2 * (576 + 192 // 2) + 2 * (576 + 1536 // 2)) + 16 * (576 // 2 + 576 + 1536 // 2
                                                                                         + 576)
    assert column + row == 10_176
    assert [r.lora for r in plan(2).ranks] == [2 * split * 30 * 2] * 2
    assert any("vLLM's buffers for 2 adapters at max_lora_rank 16" in n for n in plan(1).notes)
    on_demand = config_from_dict({"model": {"model": "smollm2-135m-instruct", "dtype": "bfloat16", "max_lora_rank": 16,
                                            "lora_dir": "/adapters", "max_loras": 3},
                                  "engine": {"backend": "vllm"}, "cache": {"num_blocks": 64},
                                  "serve": {"groups": [{"name": "g", "device_kind": "H100"}]}})
    assert plan_memory(on_demand)[0].ranks[0].lora == 3 * 16 * 10_176 * 30 * 2  # vLLM's max_loras buffers


def test_a_tensor_parallel_rank_on_the_cpu_is_counted_with_its_plain_shards_beside_their_packs(untied_dir):
    engine = make_engine(untied_dir, kv_cache_memory="3MiB", block_size=8, dtype="float32", tensor_parallel_size=2,
                         num_threads=1)
    try:
        config = engine.config.model_copy(deep=True)
        config.serve.groups[0].tensor_parallel_size = 2  # what the group of a served TP engine says
        plan = plan_memory(config)[0]
        assert plan.tensor_parallel_size == 2
        assert plan.ranks[0].target_weights == _bytes_held(engine.worker.runner.model)  # rank 0 is this process
    finally:
        engine.worker.close()
