"""Shared fixtures: tiny random-weight models saved as Hugging Face folders."""

from __future__ import annotations

import pytest
import torch

from cluster.models.tiny import (
    save_noisy_draft, save_tiny_model, save_tiny_tokenizer, tiny_llama_config, tiny_opt_config, tiny_qwen2_config,
)

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
    path = tmp_path_factory.mktemp("tiny_qwen2")
    save_tiny_model(tiny_qwen2_config(), path, seed=1)
    return path


@pytest.fixture(scope="session")
def noisy_draft_dir(tiny_llama_dir, tmp_path_factory):
    """A draft that agrees with tiny_llama often but not always: its weights plus noise."""
    path = save_noisy_draft(tiny_llama_dir, tmp_path_factory.mktemp("noisy_draft"))
    save_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_head_dir(tiny_llama_dir, tmp_path_factory):
    """An EAGLE-3 head trained briefly on tiny_llama's greedy answers to random-token prompts: it
    agrees with the target often but not always."""
    from tests.head_helpers import train_tiny_head

    return train_tiny_head(tiny_llama_dir, tmp_path_factory.mktemp("tiny_head"))
