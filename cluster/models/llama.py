"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM) over the paged KV cache.

Q, K and V are one fused projection and gate/up another, so a layer runs four
matrix multiplications. Weights load from Hugging Face names; Qwen2 adds a bias
to the QKV projection. Sliding-window attention (Mistral) is not applied: contexts
must stay within the window.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from cluster.models.layers.activation import SiluAndMul
from cluster.models.layers.attention import AttentionMetadata, PagedAttention
from cluster.models.layers.rotary import RotaryEmbedding, apply_rotary
from cluster.models.layers.weights import load_named_weights
from cluster.parallel.group import TPGroup
from cluster.parallel.layers import column_linear, embedding, head_shard, lm_head, row_linear


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.cpu_ops = None  # compiled CPU ops, set by attach_decode_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_ops is not None:
            return self.cpu_ops.rms_norm(x.contiguous(), self.weight, self.eps)
        # torch's fused kernel accumulates in float32, like the reference's upcast.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + residual, norm(x + residual))``: the residual stream's add and this norm, in one
        compiled call where there is one."""
        if self.cpu_ops is not None:
            return tuple(self.cpu_ops.add_rms_norm(x.contiguous(), residual.contiguous(), self.weight, self.eps))
        total = residual + x
        return total, self(total)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, tp: TPGroup | None = None) -> None:
        super().__init__()
        hidden = config.hidden_size
        # With tensor parallelism, the counts and sizes below are this rank's.
        heads = head_shard(config.num_attention_heads, config.num_key_value_heads,
                           1 if tp is None else tp.world_size, 0 if tp is None else tp.rank)
        self.num_heads = heads.num_heads
        self.num_kv_heads = heads.num_kv_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        full_q, full_kv = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        qkv_bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        self.qkv_proj = column_linear(hidden, [full_q, full_kv, full_kv], qkv_bias, tp, heads)
        self.o_proj = row_linear(full_q, hidden, getattr(config, "attention_bias", False), tp)
        mlp_bias = getattr(config, "mlp_bias", False)
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = column_linear(hidden, [config.intermediate_size] * 2, mlp_bias, tp)
        self.down_proj = row_linear(config.intermediate_size, hidden, mlp_bias, tp)
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)
        self.act = SiluAndMul()
        if config.hidden_act != "silu":
            raise ValueError(f"Llama-family hidden_act {config.hidden_act!r} is not supported (silu is)")

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin_signed: [num_tokens, 1, head_dim] each
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        kv_cache: torch.Tensor,  # [2, num_slots, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        residual: torch.Tensor | None = None,  # [num_tokens, hidden_size]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream entering this layer is ``hidden + residual`` (``hidden`` alone for the
        first layer, ``residual`` None); returns the stream leaving it in the same two parts, so
        each add lands in the next norm's call (``RMSNorm.add_and_norm``)."""
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            residual, normed = self.input_layernorm.add_and_norm(hidden, residual)
        qkv = self.qkv_proj(normed)
        if self.attn.decodes_in_kernel(kv_cache, meta):
            attn_out = self.attn.rotary_decode(qkv, rope, kv_cache, meta)
        else:
            num_tokens = hidden.shape[0]
            # Rotate Q and K heads together: [num_tokens, num_heads + num_kv_heads, head_dim]
            qk = apply_rotary(qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim), *rope,
                              cpu_ops=self.attn.cpu_ops)
            q = qk[:, : self.num_heads].reshape(num_tokens, self.q_size)
            k = qk[:, self.num_heads :].reshape(num_tokens, self.kv_size)
            v = qkv[:, self.q_size + self.kv_size :]
            attn_out = self.attn(q, k, v, kv_cache, meta)
        residual, normed = self.post_attention_layernorm.add_and_norm(self.o_proj(attn_out), residual)
        return self.down_proj(self.act(self.gate_up_proj(normed))), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config, max_position: int, tp: TPGroup | None = None) -> None:
        """``tp``: this rank's tensor-parallel group; None builds the plain single-device model."""
        super().__init__()
        self.config = config
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size, tp)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary = RotaryEmbedding(config, head_dim, max_position)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, tp) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        tied = self.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = lm_head(config.vocab_size, config.hidden_size, tp, tied)
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = self.layers[0].num_kv_heads  # this rank's
        self.head_dim = head_dim
        self.vocab_size = config.vocab_size
        # Layers whose input stream a draft head reads (cluster/models/eagle3.py); each forward
        # then leaves their concatenation, [num_tokens, len * hidden_size], in ``aux_hidden``.
        self.aux_layer_ids: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: torch.Tensor,  # [num_layers, 2, num_slots, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary(positions, hidden.dtype)
        aux, residual = {}, None
        for i, layer in enumerate(self.layers):
            if i in self.aux_layer_ids:  # the residual stream entering layer i
                aux[i] = hidden if residual is None else residual + hidden
            hidden, residual = layer(rope, hidden, kv_caches[i], meta, residual)
        self.aux_hidden = torch.cat([aux[i] for i in self.aux_layer_ids], dim=-1) if aux else None
        return self.norm.add_and_norm(hidden, residual)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; raises ValueError on a missing or unexpected tensor."""
        layer = self.layers[0]
        sizes = {
            "qkv_proj": [layer.q_size, layer.kv_size, layer.kv_size],
            "gate_up_proj": [layer.intermediate_size] * 2,
        }

        def rename(name: str) -> str | None:
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                return None
            return name.removeprefix("model.").replace(".self_attn.", ".").replace(".mlp.", ".")

        load_named_weights(
            self, weights, rename, _STACKED, lambda target: sizes[target.split(".")[-2]]
        )


_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
