"""Tiny random-weight EAGLE-3 heads in the published layout, for tests and the GPU checks."""

from __future__ import annotations

from pathlib import Path

import torch

from cluster.models.eagle3 import Eagle3Head, HeadConfig, default_aux_layers, save_head


def tiny_head_config(target_config, draft_vocab: int) -> HeadConfig:
    hidden = target_config.hidden_size
    return HeadConfig(
        hidden_size=hidden, num_heads=target_config.num_attention_heads,
        num_kv_heads=target_config.num_key_value_heads, head_dim=hidden // target_config.num_attention_heads,
        intermediate_size=target_config.intermediate_size, rms_norm_eps=target_config.rms_norm_eps,
        vocab_size=target_config.vocab_size, draft_vocab_size=draft_vocab, target_hidden_size=hidden,
        aux_layer_ids=default_aux_layers(target_config.num_hidden_layers), rope_theta=10000.0,
        max_position_embeddings=target_config.max_position_embeddings,
    )


def random_head(config: HeadConfig, seed: int, std: float = 0.15) -> Eagle3Head:
    """Random weights (the draft vocabulary: every other target id from 1, when reduced)."""
    torch.manual_seed(seed)
    head = Eagle3Head(config)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, std)
        if config.draft_vocab_size < config.vocab_size:
            ids = torch.arange(config.draft_vocab_size) * (config.vocab_size // config.draft_vocab_size) + 1
            head.d2t.copy_(ids.clamp(max=config.vocab_size - 1) - torch.arange(config.draft_vocab_size))
    return head


def save_random_head(target_config, path: Path, draft_vocab: int, seed: int = 0) -> Path:
    save_head(random_head(tiny_head_config(target_config, draft_vocab), seed), Path(path))
    return Path(path)
