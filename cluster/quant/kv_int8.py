"""An int8 paged KV cache (``cache.kv_cache_dtype: int8``).

Every cached K or V vector (one token, one KV head) is stored as ``head_dim`` int8
values and one float32 scale, ``scale = max |x| / 127``: per-token, per-head scales, the
finest of the usual choices, so a new token never forces a block to be re-quantized.
A 64-wide head takes 68 bytes instead of 128 (bfloat16) or 256 (float32).

Attention writes the new K/V through :meth:`Int8LayerCache.write` and reads a context
through :meth:`Int8LayerCache.gather`, which widens to the compute dtype; the
attention math after that is unchanged. The whole cache is a handful of tensors in
plain torch ops, so it runs on any device.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

SCALE_DTYPE = torch.float32


def bytes_per_vector(head_dim: int) -> int:
    """Bytes one token's K (or V) of one KV head takes: the int8 values and the scale."""
    return head_dim + torch.empty((), dtype=SCALE_DTYPE).element_size()


class Int8LayerCache(NamedTuple):
    """One layer's K and V: ``values`` [2, num_slots, num_kv_heads, head_dim] int8 and
    ``scales`` [2, num_slots, num_kv_heads] float32."""

    values: torch.Tensor
    scales: torch.Tensor
    compute_dtype: torch.dtype

    def write(
        self,
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> None:
        for i, x in enumerate((k, v)):
            q, scale = quantize_vectors(x)
            self.values[i].index_copy_(0, slot_mapping, q)
            self.scales[i].index_copy_(0, slot_mapping, scale)

    def gather(self, flat_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``flat_slots`` [n] in the compute dtype: [n, num_kv_heads, head_dim] each."""
        out = []
        for i in range(2):
            q = self.values[i].index_select(0, flat_slots)
            scale = self.scales[i].index_select(0, flat_slots)
            out.append((q.to(SCALE_DTYPE) * scale.unsqueeze(-1)).to(self.compute_dtype))
        return out[0], out[1]


class Int8KVCache:
    """All layers' int8 K/V; ``cache[layer]`` is that layer's :class:`Int8LayerCache`."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 compute_dtype: torch.dtype, device: torch.device) -> None:
        self.values = torch.zeros(num_layers, 2, num_slots, num_kv_heads, head_dim, dtype=torch.int8, device=device)
        self.scales = torch.zeros(num_layers, 2, num_slots, num_kv_heads, dtype=SCALE_DTYPE, device=device)
        self.compute_dtype = compute_dtype

    def __getitem__(self, layer: int) -> Int8LayerCache:
        return Int8LayerCache(self.values[layer], self.scales[layer], self.compute_dtype)

    def __len__(self) -> int:
        return self.values.shape[0]

    @property
    def nbytes(self) -> int:
        return self.values.numel() + self.scales.numel() * self.scales.element_size()


def quantize_vectors(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., head_dim] -> (int8 [..., head_dim], float32 scale [...]); zero vectors get scale 0."""
    x = x.to(SCALE_DTYPE)
    scale = x.abs().amax(dim=-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x / safe.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale
