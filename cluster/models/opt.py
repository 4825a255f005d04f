"""OPT (the family arXiv 2310.18813 measured) over the paged KV cache.

Learned absolute positions (offset 2, as in the HF checkpoints), LayerNorm before
(or, for opt-350m, after) each block, ReLU MLP, optional project_in/out when the
embedding width differs from the hidden size, LM head tied to the embedding.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from cluster.models.layers.attention import AttentionMetadata, PagedAttention
from cluster.models.layers.weights import load_named_weights
from cluster.parallel.group import TPGroup
from cluster.parallel.layers import column_linear, embedding, head_shard, lm_head, row_linear

_POSITION_OFFSET = 2


class OPTDecoderLayer(nn.Module):
    def __init__(self, config, tp: TPGroup | None = None) -> None:
        super().__init__()
        hidden = config.hidden_size
        bias = getattr(config, "enable_bias", True)
        affine = getattr(config, "layer_norm_elementwise_affine", True)
        heads = head_shard(config.num_attention_heads, config.num_attention_heads,
                           1 if tp is None else tp.world_size, 0 if tp is None else tp.rank)
        self.num_heads = heads.num_heads  # this rank's
        self.head_dim = hidden // config.num_attention_heads
        self.qkv_proj = column_linear(hidden, [hidden] * 3, bias, tp)
        self.out_proj = row_linear(hidden, hidden, bias, tp)
        self.self_attn_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.fc1 = column_linear(hidden, [config.ffn_dim], bias, tp)
        self.fc2 = row_linear(config.ffn_dim, hidden, bias, tp)
        self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.pre_norm = config.do_layer_norm_before
        self.attn = PagedAttention(self.num_heads, self.num_heads, self.head_dim, self.head_dim**-0.5)
        if config.activation_function != "relu":
            raise ValueError(f"OPT activation {config.activation_function!r} is not supported (relu is)")

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        kv_cache: torch.Tensor,  # [2, num_slots, num_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        residual = hidden
        if self.pre_norm:
            hidden = self.self_attn_layer_norm(hidden)
        q, k, v = self.qkv_proj(hidden).chunk(3, dim=-1)
        hidden = residual + self.out_proj(self.attn(q, k, v, kv_cache, meta))
        if not self.pre_norm:
            hidden = self.self_attn_layer_norm(hidden)
        residual = hidden
        if self.pre_norm:
            hidden = self.final_layer_norm(hidden)
        hidden = residual + self.fc2(F.relu(self.fc1(hidden)))
        if not self.pre_norm:
            hidden = self.final_layer_norm(hidden)
        return hidden


class OPTForCausalLM(nn.Module):
    def __init__(self, config, max_position: int, tp: TPGroup | None = None) -> None:
        """``tp``: this rank's tensor-parallel group; None builds the plain single-device model."""
        super().__init__()
        self.config = config
        hidden, embed_dim = config.hidden_size, config.word_embed_proj_dim
        self.embed_tokens = embedding(config.vocab_size, embed_dim, tp)
        self.embed_positions = nn.Embedding(config.max_position_embeddings + _POSITION_OFFSET, hidden)
        self.project_in = nn.Linear(embed_dim, hidden, bias=False) if embed_dim != hidden else None
        self.project_out = nn.Linear(hidden, embed_dim, bias=False) if embed_dim != hidden else None
        self.layers = nn.ModuleList(OPTDecoderLayer(config, tp) for _ in range(config.num_hidden_layers))
        has_final_norm = config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False)
        affine = getattr(config, "layer_norm_elementwise_affine", True)
        self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine) if has_final_norm else None
        self.lm_head = lm_head(config.vocab_size, embed_dim, tp, self.embed_tokens)  # OPT always ties the head
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = self.layers[0].num_heads  # this rank's
        self.head_dim = hidden // config.num_attention_heads
        self.vocab_size = config.vocab_size
        if max_position > config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_position} exceeds OPT's {config.max_position_embeddings} learned positions"
            )

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: torch.Tensor,  # [num_layers, 2, num_slots, num_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, word_embed_proj_dim]
        hidden = self.embed_tokens(input_ids)
        if self.project_in is not None:
            hidden = self.project_in(hidden)
        hidden = hidden + self.embed_positions(positions + _POSITION_OFFSET)
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, kv_caches[i], meta)
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, embed] -> [n, vocab]
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; raises ValueError on a missing or unexpected tensor."""
        hidden = self.config.hidden_size

        def rename(name: str) -> str | None:
            if name == "lm_head.weight":
                return None  # tied
            name = name.removeprefix("model.").removeprefix("decoder.")
            return name.replace(".self_attn.out_proj.", ".out_proj.").replace(".self_attn.", ".")

        load_named_weights(self, weights, rename, _STACKED, lambda target: [hidden] * 3)


_STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
