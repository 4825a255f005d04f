"""Rotary position embedding with a precomputed cos/sin table.

Frequencies come from ``transformers``' own RoPE initialisers, so every scaling type a
Hugging Face config can name (linear, llama3, yarn, longrope, ...) is computed the way
the reference computes it. Rotation is the "rotate half" layout HF Llama weights use;
cos/sin are looked up once per step and shared by every layer.
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
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.empty(0).device)
        else:
            raise ValueError(f"unknown rope_type {rope_type!r}; known: default, {sorted(ROPE_INIT_FUNCTIONS)}")
        # Every tensor here lands on torch's default device (a model built under ``with torch.device("cuda")``
        # builds its table there), transformers' initialiser included: it is handed that device.
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.float())  # [max_position, head_dim / 2]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)  # [max_position, head_dim]
        sin = emb.sin() * scaling
        half = head_dim // 2
        # rotate_half(x) = [-x2, x1] = roll(x, half) * [-1 ... -1, 1 ... 1]
        sign = torch.cat([-torch.ones(half), torch.ones(half)])
        self.register_buffer("sin_signed", sin * sign, persistent=False)
        self.head_dim = head_dim

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype  # positions: [num_tokens]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin for ``apply_rotary``, once per step: [num_tokens, 1, head_dim] each."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin_signed[positions].unsqueeze(1).to(dtype)


def apply_rotary(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim]
    sin_signed: torch.Tensor,  # [num_tokens, 1, head_dim]
    cpu_ops=None,  # the compiled CPU ops (cluster/kernels/decode_ops.cpp), where the caller has them
) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half done as one roll (sin carries the sign).
    With ``cpu_ops``, on the CPU, one compiled call gives the same values (torch's roundings)
    without the three ops' intermediate tensors."""
    if cpu_ops is not None and x.device.type == "cpu" and x.dtype == cos.dtype:
        return cpu_ops.rotary(x, cos, sin_signed)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed
