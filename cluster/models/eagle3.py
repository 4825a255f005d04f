"""An EAGLE-3 draft head (arXiv 2503.01840): one decoder layer over the target's own hidden states.

The head reads, for each token position ``p`` the target verified, the target's residual
stream entering three of its layers (low, middle, high: ``aux_layer_ids``), fused to one
hidden vector by ``fc``, together with the embedding of the token at ``p + 1``, and predicts
the token at ``p + 2``. Its later draft steps feed back its own output (before the final
norm) in place of the target's fused states. The decoder layer's attention takes the
concatenation ``[norm(embedding), norm(hidden)]`` (twice the hidden size) as input, its
residual is the hidden vector, and its output layer covers a reduced draft vocabulary whose
ids map back to the target's through ``d2t`` (``target = draft + d2t[draft]``).

Parameter names are the published EAGLE-3 checkpoint layout that vLLM and SGLang load
(``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``; ``config.json`` with
``draft_vocab_size``), so :func:`load_head` reads those folders and :func:`save_head` writes one.
The embedding is the target's (a checkpoint's own ``embed_tokens`` is used when present).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from cluster.models.layers.attention import AttentionMetadata, PagedAttention
from cluster.models.layers.rotary import RotaryEmbedding, apply_rotary
from cluster.models.llama import RMSNorm

ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """The layers EAGLE-3 reads when a checkpoint names none: vLLM's and SGLang's default
    ``(2, L // 2, L - 3)``, kept within the layers of a target shallower than 6."""
    return tuple(min(max(i, 0), num_target_layers - 1) for i in (2, num_target_layers // 2, num_target_layers - 3))


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict | None = None  # as a Hugging Face config names it (llama3, yarn, ...)

    @classmethod
    def from_json(cls, data: dict, num_target_layers: int | None = None) -> "HeadConfig":
        """A published ``config.json``; ``num_target_layers`` fills in the default aux layers."""
        if data.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"an EAGLE-3 head has one decoder layer, this config has {data['num_hidden_layers']}")
        if data.get("hidden_act", "silu") != "silu":
            raise ValueError(f"EAGLE-3 heads with hidden_act {data['hidden_act']!r} are not supported (silu is)")
        hidden = data["hidden_size"]
        aux = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if aux is None:
            if num_target_layers is None:
                raise ValueError("the head names no eagle_aux_hidden_state_layer_ids and the target's depth is unknown")
            aux = default_aux_layers(num_target_layers)
        heads = data["num_attention_heads"]
        params = data.get("rope_parameters") or {}  # transformers 5's name for theta and scaling together
        scaling = data.get("rope_scaling") or ({k: v for k, v in params.items() if k != "rope_theta"}
                                               if params.get("rope_type", "default") != "default" else None)
        return cls(
            hidden_size=hidden, num_heads=heads, num_kv_heads=data.get("num_key_value_heads", heads),
            head_dim=data.get("head_dim") or hidden // heads, intermediate_size=data["intermediate_size"],
            rms_norm_eps=data.get("rms_norm_eps", 1e-6), vocab_size=data["vocab_size"],
            draft_vocab_size=data.get("draft_vocab_size") or data["vocab_size"],
            target_hidden_size=data.get("target_hidden_size") or hidden, aux_layer_ids=tuple(aux),
            rope_theta=float(data.get("rope_theta") or (data.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            max_position_embeddings=data.get("max_position_embeddings", 4096),
            rope_scaling=scaling,
        )

    def to_json(self) -> dict:
        return {
            "architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_size": self.hidden_size, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size, "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings, "tie_word_embeddings": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)},
        }


class HeadAttention(nn.Module):
    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        width = 2 * config.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj = nn.Linear(width, config.num_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(width, config.num_kv_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(width, config.num_kv_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)

    def rotated_qkv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """q [n, heads, dim], k and v [n, kv_heads, dim], q and k rotated; x is [n, 2 * hidden]."""
        n = x.shape[0]
        q = apply_rotary(self.q_proj(x).view(n, self.num_heads, self.head_dim), *rope)
        k = apply_rotary(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim), *rope)
        return q, k, self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)


class HeadMLP(nn.Module):
    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class HeadLayer(nn.Module):
    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = HeadAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = HeadMLP(config)
        # Inference only (:meth:`Eagle3Head.fuse_projections`): Q, K, V as one matrix, gate and up as another.
        self.qkv_proj: nn.Linear | None = None
        self.gate_up_proj: nn.Linear | None = None

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, attn_out: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's output (the residual stream, before the head's final norm)."""
        hidden = hidden + self.self_attn.o_proj(attn_out)
        normed = self.post_attention_layernorm(hidden)
        if self.gate_up_proj is None:
            return hidden + self.mlp(normed)
        gate, up = self.gate_up_proj(normed).chunk(2, dim=-1)
        return hidden + self.mlp.down_proj(F.silu(gate) * up)


class Eagle3Head(nn.Module):
    def __init__(self, config: HeadConfig, max_position: int | None = None) -> None:
        """``max_position``: the longest context it drafts in (default: the config's)."""
        super().__init__()
        self.config = config
        self.fc = nn.Linear(len(config.aux_layer_ids) * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = HeadLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.embed_tokens: nn.Embedding | None = None  # its own, when a checkpoint has one
        # here, not at the top: transformers' model configs would load with every server import
        from transformers import LlamaConfig

        rope = LlamaConfig(hidden_size=config.hidden_size, num_attention_heads=config.num_heads,
                           head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
                           rope_theta=config.rope_theta, rope_scaling=config.rope_scaling)
        self.rotary = RotaryEmbedding(rope, config.head_dim, max_position or config.max_position_embeddings)
        self.attn = PagedAttention(config.num_heads, config.num_kv_heads, config.head_dim, config.head_dim**-0.5)

    def fuse_projections(self) -> None:
        """For inference: one matrix for Q, K and V and one for gate and up (as the target's layers
        have), so a draft step runs four matrix products and the compiled attention kernel can take
        its QKV; the separate matrices are dropped (the head can no longer be saved)."""
        layer, attn, mlp = self.midlayer, self.midlayer.self_attn, self.midlayer.mlp
        layer.qkv_proj = _stacked([attn.q_proj, attn.k_proj, attn.v_proj])
        layer.gate_up_proj = _stacked([mlp.gate_proj, mlp.up_proj])
        del attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's concatenated aux states [n, len(aux) * target_hidden] -> [n, hidden]."""
        return self.fc(aux)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def forward(
        self,
        embeds: torch.Tensor,  # [n, hidden]: embeddings of the tokens at positions + 1
        hidden: torch.Tensor,  # [n, hidden]: fused target states, or the head's own previous outputs
        positions: torch.Tensor,  # [n]
        kv_cache: torch.Tensor,  # [2, num_slots, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [n, hidden]: the layer's output before the final norm
        layer = self.midlayer
        x = layer.attention_input(embeds, hidden)
        rope = self.rotary(positions, hidden.dtype)
        if layer.qkv_proj is not None and self.attn.decodes_in_kernel(kv_cache, meta):
            attn_out = self.attn.rotary_decode(layer.qkv_proj(x), rope, kv_cache, meta)
        else:
            if layer.qkv_proj is not None:
                q, k, v = _split_qkv(layer.qkv_proj(x), self.config, rope)
            else:
                q, k, v = layer.self_attn.rotated_qkv(x, rope)
            n = q.shape[0]
            attn_out = self.attn(q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1), kv_cache, meta)
        return layer.finish(attn_out, hidden)

    def logits(self, out: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, draft_vocab] float32
        return self.lm_head(self.norm(out)).float()


def _stacked(linears: list[nn.Linear]) -> nn.Linear:
    weight = torch.cat([lin.weight.detach() for lin in linears])
    stacked = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    stacked.weight.data.copy_(weight)
    return stacked


def _split_qkv(qkv: torch.Tensor, config: HeadConfig, rope: tuple[torch.Tensor, torch.Tensor]):
    n, dim = qkv.shape[0], config.head_dim
    q_size, kv_size = config.num_heads * dim, config.num_kv_heads * dim
    q = apply_rotary(qkv[:, :q_size].reshape(n, config.num_heads, dim), *rope)
    k = apply_rotary(qkv[:, q_size : q_size + kv_size].reshape(n, config.num_kv_heads, dim), *rope)
    return q, k, qkv[:, q_size + kv_size :].reshape(n, config.num_kv_heads, dim)


WEIGHTS_FILE = "model.safetensors"


def save_head(head: Eagle3Head, out: Path, dtype: torch.dtype | None = None) -> None:
    """A published-layout folder: ``config.json`` and ``model.safetensors`` (with ``t2d``); ``dtype``
    stores the weights in another floating type (``torch_dtype`` in the config says which)."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in head.state_dict().items() if not k.startswith("rotary.")}
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    t2d = torch.zeros(head.config.vocab_size, dtype=torch.bool)
    t2d[head.to_target_ids(torch.arange(head.config.draft_vocab_size))] = True
    tensors["t2d"] = t2d
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    stored = next(v.dtype for v in tensors.values() if v.is_floating_point())
    (out / "config.json").write_text(json.dumps({**head.config.to_json(), "torch_dtype": str(stored).removeprefix("torch.")},
                                                indent=1))


def load_head(folder: Path, num_target_layers: int | None = None, max_position: int | None = None) -> Eagle3Head:
    """A head from a published-layout folder (``model.safetensors`` or ``pytorch_model.bin``);
    raises ValueError naming what is missing or unexpected."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{folder} holds no config.json: not an EAGLE-3 head folder")
    config = HeadConfig.from_json(json.loads(config_path.read_text()), num_target_layers)
    tensors = _read_tensors(folder)
    head = Eagle3Head(config, max_position)
    renamed = {}
    for name, tensor in tensors.items():
        name = name.removeprefix("model.").replace("layers.0.", "midlayer.")
        if name == "t2d":
            continue
        renamed[name] = tensor
    if "embed_tokens.weight" in renamed:
        weight = renamed.pop("embed_tokens.weight")
        head.embed_tokens = nn.Embedding(weight.shape[0], weight.shape[1])
        head.embed_tokens.weight.data.copy_(weight)
    if "d2t" not in renamed:
        if config.draft_vocab_size != config.vocab_size:
            raise ValueError(f"{folder}: a head with a reduced draft vocabulary needs its d2t map")
        renamed["d2t"] = torch.zeros(config.vocab_size, dtype=torch.int64)
    expected = {k for k in head.state_dict() if not k.startswith("rotary.")}
    missing, unexpected = expected - set(renamed), set(renamed) - expected
    if missing or unexpected:
        raise ValueError(f"{folder}: not the EAGLE-3 layout (missing {sorted(missing)}, unexpected {sorted(unexpected)})")
    renamed["d2t"] = renamed["d2t"].to(torch.int64)
    for name, tensor in renamed.items():
        current = head.get_parameter(name) if name != "d2t" else head.d2t
        tensor = tensor.to(current.dtype)
        if current.shape != tensor.shape:
            raise ValueError(f"{folder}: {name} has shape {tuple(tensor.shape)}, the config implies "
                             f"{tuple(current.shape)}")
        current.data.copy_(tensor)
    return head


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / WEIGHTS_FILE).is_file():
        return load_file(str(folder / WEIGHTS_FILE))
    if (folder / "pytorch_model.bin").is_file():
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ValueError(f"{folder} holds neither {WEIGHTS_FILE} nor pytorch_model.bin")
