"""A model's shape, read without loading it: from its folder's config.json, or from a table of
well-known models when the folder is not on this machine (a GPU config checked on a laptop).

The shape is what memory planning needs: parameter counts by kind (split across tensor
parallel ranks or not) and the K/V width per token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    source: str  # where the shape came from: a config.json path, or "known shape of ..."
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def linear_params(self) -> int:
        """The decoder's linear layers plus the LM head when it is its own matrix."""
        attention = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.num_layers * (attention + mlp) + head

    @property
    def num_params(self) -> int:
        norms = (2 * self.num_layers + 1) * self.hidden_size
        return self.embedding_params + self.linear_params + norms


# Public architecture facts (each model's config.json), keyed by a lowercase fragment of its name.
KNOWN_SHAPES: dict[str, tuple[int, int, int, int, int, int, int, bool]] = {
    # hidden, layers, heads, kv heads, head dim, intermediate, vocab, tied
    "llama-3.1-8b": (4096, 32, 32, 8, 128, 14336, 128256, False),
    "llama-3-8b": (4096, 32, 32, 8, 128, 14336, 128256, False),
    "llama-3.1-70b": (8192, 80, 64, 8, 128, 28672, 128256, False),
    "llama-3.3-70b": (8192, 80, 64, 8, 128, 28672, 128256, False),
    "llama-3.2-1b": (2048, 16, 32, 8, 64, 8192, 128256, True),
    "llama-3.2-3b": (3072, 28, 24, 8, 128, 8192, 128256, True),
    "qwen2.5-0.5b": (896, 24, 14, 2, 64, 4864, 151936, True),
    "qwen2.5-1.5b": (1536, 28, 12, 2, 128, 8960, 151936, True),
    "qwen2.5-7b": (3584, 28, 28, 4, 128, 18944, 152064, False),
    "qwen2.5-72b": (8192, 80, 64, 8, 128, 29568, 152064, False),
    "smollm2-135m": (576, 30, 9, 3, 64, 1536, 49152, True),
}


def shape_from_config(config: dict, source: str) -> ModelShape:
    heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    return ModelShape(
        source=source,
        hidden_size=hidden,
        num_layers=config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or hidden // heads,
        intermediate_size=config.get("intermediate_size") or config.get("ffn_dim") or 4 * hidden,
        vocab_size=config["vocab_size"],
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


def model_shape(name_or_path: str) -> ModelShape | None:
    """The shape of a model folder (its config.json), else of a known model whose name the
    path contains; None when neither is there."""
    config_file = Path(name_or_path).expanduser() / "config.json"
    if config_file.is_file():
        return shape_from_config(json.loads(config_file.read_text()), str(config_file))
    lowered = Path(name_or_path).name.lower().replace("meta-llama-", "llama-")
    for fragment, values in sorted(KNOWN_SHAPES.items(), key=lambda item: -len(item[0])):
        if fragment in lowered:
            return ModelShape(f"known shape of {fragment}", *values)
    return None
