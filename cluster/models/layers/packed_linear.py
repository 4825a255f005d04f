"""Linear layers with weights pre-packed for oneDNN (CPU).

``F.linear`` on the CPU hands oneDNN a plain row-major weight and lets it reorder the
weight into its blocked layout on every call. Reordering once at load time and calling
oneDNN's linear directly saves that work: on SmolLM2's shapes in bfloat16 (AMX) all
linear layers of a decode step took 32-43 ms for 1-32 rows instead of 40-46 ms, and
whole-engine decoding ran 10-18% faster at batch 1, 8 and 32 (2-core CPU, A/B in one
process). bfloat16 results are bit-identical to ``F.linear``.

float32 loses at 1 row and gains from 2 rows on: on an AVX-512/AMX CPU +35% at 8 rows,
+25% at 32, -15% at 1; on a 2-core AVX2 CPU, SmolLM2's four layer shapes together took
437 / 425 / 470 us packed against 768 / 1074 / 990 us with ``F.linear`` at 2 / 3 / 4 rows
(``F.linear`` is slow at 2-4 rows there, exactly the rows that verify 1-3 draft tokens) and
476 against 430 us at 1 row. So float32 layers keep the plain weight too and take it below
``_FLOAT32_MIN_PACKED_ROWS`` rows; that doubles their weight memory, acceptable for the
small float32 models CPUs serve.

On other devices, other dtypes, or a torch without oneDNN, ``pack_linears`` leaves the
model untouched, so the model code is the same everywhere.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

# oneDNN picks its blocked layout for this many rows; packed weights serve any row count.
_PACK_ROWS_HINT = 32
_PACKED_DTYPES = (torch.bfloat16, torch.float32)
_FLOAT32_MIN_PACKED_ROWS = 2


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS_HINT))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.min_packed_rows = _FLOAT32_MIN_PACKED_ROWS if weight.dtype == torch.float32 else 0
        self.plain_weight = weight if self.min_packed_rows else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out]
        if x.shape[0] < self.min_packed_rows:
            return F.linear(x, self.plain_weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype in _PACKED_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and onednn_packs(dtype)
    )


@functools.lru_cache(maxsize=None)
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN packs and runs ``dtype`` weights: its bfloat16 path
    needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT and raises on a plain AVX2 CPU, where
    the model then keeps ``F.linear``. Probed once per dtype on a tiny layer."""
    try:
        weight = torch.ones(8, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS_HINT)
        torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=dtype), packed, None, "none", [], "")
    except RuntimeError as err:
        logger.info("oneDNN cannot pack %s linear weights on this CPU (%s); using F.linear", dtype, err)
        return False
    return True


def pack_linears(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`PackedLinear` where it pays.

    Call after the weights are loaded. A head tied to the embedding keeps the embedding
    and gets a packed copy. Returns the number of layers replaced.
    """
    if not can_pack(device, dtype):
        return 0
    replaced = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, child_name, PackedLinear(child))
                replaced += 1
    logger.info("packed %d linear layers for oneDNN", replaced)
    return replaced
