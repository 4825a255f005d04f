"""Turning a loaded model's linear layers into int8 ones (``model.quantization``)."""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
from torch import nn

from cluster.parallel.layers import ColumnParallelLinear, RowParallelLinear
from cluster.quant.int8_linear import Int8Linear

logger = logging.getLogger(__name__)


class QuantizeReport(NamedTuple):
    num_layers: int
    bytes_before: int  # of the replaced layers' weights
    bytes_after: int


def quantize_linears(model: nn.Module, scheme: str) -> QuantizeReport:
    """Replace every ``nn.Linear`` of ``model`` (the LM head included, also when it is tied
    to the embedding, which keeps its full-precision table) by an :class:`Int8Linear`, and
    give tensor-parallel linear layers an int8 copy of their shard. Call after loading and
    before ``pack_linears``. The embedding and the norms stay in the model's dtype."""
    num_layers = bytes_before = bytes_after = 0
    for module in list(model.modules()):
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            bias = module.bias if isinstance(module, ColumnParallelLinear) else None  # row: added after all-reduce
            int8 = Int8Linear(module.weight, bias, scheme)
            bytes_before += _bytes(module.weight)
            module.packed = int8
            module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)  # free the shard
            num_layers, bytes_after = num_layers + 1, bytes_after + int8.weight_bytes
            continue
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                int8 = Int8Linear(child.weight, child.bias, scheme)
                setattr(module, name, int8)
                num_layers, bytes_before, bytes_after = (
                    num_layers + 1, bytes_before + _bytes(child.weight), bytes_after + int8.weight_bytes)
    logger.info("quantized %d linear layers to %s: %.1f MB -> %.1f MB", num_layers, scheme,
                bytes_before / 1e6, bytes_after / 1e6)
    return QuantizeReport(num_layers, bytes_before, bytes_after)


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
