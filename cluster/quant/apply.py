"""Turning a loaded model's linear layers into int8 or 4-bit ones (``model.quantization``)."""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
from torch import nn

from cluster.parallel.layers import ColumnParallelLinear, RowParallelLinear
from cluster.quant.int4_linear import Int4Linear
from cluster.quant.int8_linear import Int8Linear

logger = logging.getLogger(__name__)


class QuantizeReport(NamedTuple):
    num_layers: int
    bytes_before: int  # of the replaced layers' weights
    bytes_after: int


def quantize_linears(model: nn.Module, scheme: str) -> QuantizeReport:
    """Replace every ``nn.Linear`` of ``model`` (the LM head included, also when it is tied
    to the embedding, which keeps its full-precision table) by an :class:`Int8Linear` (or an
    :class:`Int4Linear` for ``int4``), and
    give tensor-parallel linear layers a quantized copy of their shard. Call after loading and
    before ``pack_linears``. The embedding and the norms stay in the model's dtype."""
    num_layers = bytes_before = bytes_after = 0
    for module in list(model.modules()):
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            bias = module.bias if isinstance(module, ColumnParallelLinear) else None  # row: added after all-reduce
            layer = _quantized(module.weight, bias, scheme)
            bytes_before += _bytes(module.weight)
            module.packed = layer
            module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)  # free the shard
            num_layers, bytes_after = num_layers + 1, bytes_after + layer.weight_bytes
            continue
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                layer = _quantized(child.weight, child.bias, scheme)
                setattr(module, name, layer)
                num_layers, bytes_before, bytes_after = (
                    num_layers + 1, bytes_before + _bytes(child.weight), bytes_after + layer.weight_bytes)
    logger.info("quantized %d linear layers to %s: %.1f MB -> %.1f MB", num_layers, scheme,
                bytes_before / 1e6, bytes_after / 1e6)
    return QuantizeReport(num_layers, bytes_before, bytes_after)


def _quantized(weight: torch.Tensor, bias: torch.Tensor | None, scheme: str) -> nn.Module:
    return Int4Linear(weight, bias) if scheme == "int4" else Int8Linear(weight, bias, scheme)


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
