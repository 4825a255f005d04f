"""Shared fixtures: tiny random-weight models saved as Hugging Face folders."""

from __future__ import annotations

import pytest
import torch

from cluster.models.tiny import save_tiny_model, save_tiny_tokenizer, tiny_llama_config, tiny_opt_config

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_model(tiny_llama_config(), path, seed=0)
    save_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_opt_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_opt")
    save_tiny_model(tiny_opt_config(), path, seed=0)
    save_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    """Llama family with a QKV bias (Qwen2) and llama3 RoPE scaling."""
    from transformers import Qwen2Config

    config = Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
    )
    path = tmp_path_factory.mktemp("tiny_qwen2")
    save_tiny_model(config, path, seed=1)
    return path


@pytest.fixture(scope="session")
def noisy_draft_dir(tiny_llama_dir, tmp_path_factory):
    """A draft that agrees with tiny_llama often but not always: its weights plus noise."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.3 * p.std())
    path = tmp_path_factory.mktemp("noisy_draft")
    model.save_pretrained(path)
    save_tiny_tokenizer(path)
    return path
