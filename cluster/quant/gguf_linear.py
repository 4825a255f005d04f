"""Linear layers that compute from a GGUF file's own quantized blocks (``model.quantization: gguf``).

A layer keeps the rows of its weight as the file holds them (:mod:`cluster.models.gguf_blocks`; a
stacked projection such as ``qkv_proj`` keeps one part per run of rows in one format) and, beside
them, ``dense``: the same values widened to the model's dtype, the layer the model had. Calls of up
to ``max_rows`` rows on the CPU (decode steps, verification of drafts; at most the kernel's 64, as
:mod:`cluster.quant.gguf_rows` measured) run ``gguf_gemm`` on the blocks, reading 4.5-8.5 bits a
weight instead of 16 or 32; longer calls (prompts, large batches), where arithmetic and not the
weight's bytes bounds a step, and every call on other devices take ``dense`` (packed for the CPU by
``pack_linears`` like any other layer), so they cost what they cost before.

The kernel quantizes each row of x to int8 per 32 inputs (as llama.cpp does for these formats) and,
with ``residual`` (``model.gguf_activations: int8+residual``, the default), quantizes what those codes
missed the same way and adds both products: about 15 bits of each activation instead of 8, at up to
twice the integer work. Its results differ from ``dense``'s by that rounding; every row is computed
alike whatever shares the call, so a verification row reproduces a decode row and speculation
stays exact.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
from torch import nn

from cluster.kernels.build import gguf_gemm
from cluster.models.gguf_blocks import BlockFormat, row_bytes
from cluster.quant.gguf_tiles import tile_rows

logger = logging.getLogger(__name__)

# The projections of a Llama layer and the Hugging Face tensors stacked into each, in row order.
_STACKED_PARTS = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}


class BlockPart(NamedTuple):
    raw: torch.Tensor  # [rows, row_bytes] uint8
    fmt: BlockFormat


class GGUFLinear(nn.Module):
    """``y = x @ W.T + b`` from GGUF blocks for few rows, from ``dense`` otherwise (module docstring)."""

    def __init__(self, dense: nn.Linear, parts: list[BlockPart], residual: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = dense.in_features, dense.out_features
        merged: list[BlockPart] = []
        for part in parts:  # neighbouring parts of one format become one call
            if merged and merged[-1].fmt == part.fmt:
                merged[-1] = BlockPart(torch.cat([merged[-1].raw, part.raw]), part.fmt)
            else:
                merged.append(part)
        if sum(p.raw.shape[0] for p in merged) != self.out_features:
            raise ValueError(f"GGUF blocks hold {sum(p.raw.shape[0] for p in merged)} rows, the layer "
                             f"{self.out_features}")
        for part in merged:
            if part.raw.dtype != torch.uint8 or part.raw.shape[1] != row_bytes(part.fmt, self.in_features):
                raise ValueError(f"{part.fmt.name} rows of {part.raw.shape[1]} bytes do not hold "
                                 f"{self.in_features} weights")
        self.dense = dense
        self.formats = [p.fmt for p in merged]
        self._kernel = gguf_gemm() if dense.weight.device.type == "cpu" else None
        self.max_rows = self._kernel.max_rows if self._kernel is not None else 0  # the rows probe may lower it
        self.residual = residual
        # On the CPU the formats with a tile layout keep only their tiles (the same bytes, reordered).
        tiles = [tile_rows(p.raw, p.fmt) if self._kernel is not None else None for p in merged]
        self.tile_kinds = [None if t is None else t.kind for t in tiles]
        for i, (part, tiled) in enumerate(zip(merged, tiles)):
            self.register_buffer(f"blocks_{i}", part.raw.contiguous() if tiled is None else tiled.data)
        starts = [0]
        for part in merged:
            starts.append(starts[-1] + part.raw.shape[0])
        bias = dense.bias
        self._calls = [(part.fmt, kind, b - a, None if bias is None else bias.detach()[a:b].float().contiguous())
                       for part, kind, a, b in zip(merged, self.tile_kinds, starts, starts[1:])]

    @property
    def blocks(self) -> list[torch.Tensor]:
        """Each part's bytes: the file's rows, or their tiles where ``tile_kinds`` names a kind."""
        return [getattr(self, f"blocks_{i}") for i in range(len(self.formats))]

    @property
    def block_bytes(self) -> int:
        return sum(b.numel() for b in self.blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out]
        if self._kernel is None or not 0 < x.shape[0] <= self.max_rows or x.dtype not in (
                torch.float32, torch.bfloat16):
            return self.dense(x)
        x = x.contiguous()
        outs = []
        for i, (fmt, kind, rows, bias) in enumerate(self._calls):  # a decode step's hot path: no lookups
            data = self._buffers[f"blocks_{i}"]
            if kind is None:
                outs.append(self._kernel.linear(x, data, fmt.ggml_type, bias, self.residual))
            else:
                outs.append(self._kernel.linear_tiles(x, data, kind, rows, bias, self.residual))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def extra_repr(self) -> str:
        names = "+".join(f.name for f in self.formats)
        return f"in_features={self.in_features}, out_features={self.out_features}, blocks={names}"


class GGUFReport(NamedTuple):
    num_layers: int  # layers that compute from blocks
    num_dense: int  # linear layers left without blocks (their tensors were not in a served format)
    block_bytes: int


def use_gguf_blocks(model: nn.Module, blocks: dict[str, tuple[torch.Tensor, BlockFormat]],
                    tie_word_embeddings: bool, residual: bool = True) -> GGUFReport:
    """Give each linear layer of a Llama ``model`` whose every stacked tensor is in ``blocks`` (HF name
    -> raw rows and format) a :class:`GGUFLinear`; the LM head takes the embedding's blocks when tied.
    Call after loading and before ``pack_linears``. Layers missing a tensor keep their weights."""
    num_layers = num_dense = block_bytes = 0
    for module_name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is not nn.Linear:
                continue
            names = _hf_names(f"{module_name}.{child_name}" if module_name else child_name, tie_word_embeddings)
            if names is None or any(n not in blocks for n in names):
                num_dense += 1
                continue
            layer = GGUFLinear(child, [BlockPart(*blocks[n]) for n in names], residual)
            setattr(module, child_name, layer)
            num_layers, block_bytes = num_layers + 1, block_bytes + layer.block_bytes
    logger.info("%d linear layers compute from the GGUF blocks (%.1f MB), %d keep widened weights", num_layers,
                block_bytes / 1e6, num_dense)
    return GGUFReport(num_layers, num_dense, block_bytes)


def _hf_names(path: str, tie_word_embeddings: bool) -> list[str] | None:
    """The Hugging Face tensors stacked into the Llama module at ``path``, or None for another module."""
    if path == "lm_head":
        return ["model.embed_tokens.weight" if tie_word_embeddings else "lm_head.weight"]
    prefix, _, leaf = path.rpartition(".")
    if leaf not in _STACKED_PARTS or not prefix.startswith("layers."):
        return None
    return [f"model.{prefix}.{part}.weight" for part in _STACKED_PARTS[leaf]]
