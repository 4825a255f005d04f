"""Rotary position embedding with a precomputed cos/sin table.

Frequencies come from ``transformers``' own RoPE initialisers, so every scaling type a
Hugging Face config can name (linear, llama3, yarn, longrope, ...) is computed the way
the reference computes it. Rotation is the "rotate half" layout HF Llama weights use.
"""

from __future__ import annotations

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def _default_inv_freq(config, head_dim: int) -> torch.Tensor:
    base = config.rope_parameters["rope_theta"]
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, config, head_dim: int, max_position: int) -> None:
        super().__init__()
        params = getattr(config, "rope_parameters", None) or {"rope_type": "default"}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            inv_freq, scaling = _default_inv_freq(config, head_dim), 1.0
        elif rope_type == "dynamic":
            raise ValueError("dynamic NTK RoPE scaling is not supported; use linear, yarn or llama3")
        elif rope_type in ROPE_INIT_FUNCTIONS:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        else:
            raise ValueError(f"unknown rope_type {rope_type!r}; known: default, {sorted(ROPE_INIT_FUNCTIONS)}")
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.float())  # [max_position, head_dim / 2]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)  # [max_position, head_dim]
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)
        self.head_dim = head_dim

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        q: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [num_tokens, 1, head_dim]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(shape[0], -1, self.head_dim)
        half = self.head_dim // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return (x * cos + rotated * sin).view(shape)
