"""The gated MLP's activation: silu(gate) * up on the fused gate|up projection's output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``[..., 2 * n]`` (gate | up) -> ``[..., n]``; one compiled call on the CPU where
    :func:`~cluster.models.layers.cpu_ops.attach_decode_ops` gave it the ops (same rounding as
    torch's two ops), torch's ops everywhere else."""

    def __init__(self) -> None:
        super().__init__()
        self.cpu_ops = None  # compiled CPU ops, set by attach_decode_ops

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.cpu_ops is not None:
            return self.cpu_ops.silu_and_mul(gate_up.contiguous())
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
