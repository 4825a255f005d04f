"""Hand a loaded model's RMSNorms, MLP activations and paged attention the compiled decode-step ops.

On the CPU in float32 or bfloat16, :func:`attach_decode_ops` gives every
:class:`~cluster.models.llama.RMSNorm`, :class:`~cluster.models.layers.activation.SiluAndMul` and
:class:`~cluster.models.layers.attention.PagedAttention` the module built from
``cluster/kernels/decode_ops.cpp``: one call per norm (with the residual add before it, where the
layer has one) instead of torch's composite (17-22 us a call on a 2-core CPU), one for the MLP's
silu(gate) * up instead of a chunk and two ops, and one call per layer for the
attention of short-query steps (decode, draft verification, chunks of up to
``SHORT_QUERY_MAX`` tokens per sequence: rotary, the K/V write, attention through the slot
table, one query row at a time) instead of gathering the context and running batched
matmuls; longer queries get their rotary in one call (``apply_rotary``). In bfloat16, attention also gets the compiled prefill attention for longer queries
where it measured faster than SDPA (:func:`~cluster.kernels.prefill_choice.prefill_kernel_for`).
The attention kernel reads plain and int8 KV caches alike. Modules keep their torch code for
every other case (CUDA, other dtypes), so
the model code is the same everywhere.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from cluster.kernels.build import decode_ops
from cluster.kernels.prefill_choice import prefill_kernel_for

logger = logging.getLogger(__name__)

_DTYPES = (torch.float32, torch.bfloat16)


def attach_decode_ops(model: nn.Module, device: torch.device, dtype: torch.dtype, batch_invariant: bool = False) -> int:
    """Set ``cpu_ops`` on every module that has the attribute; returns how many. With
    ``batch_invariant`` every such module must get them (ValueError otherwise): its steps
    then all run in the kernel, one query row at a time."""
    if device.type != "cpu" or dtype not in _DTYPES:
        if batch_invariant:
            raise ValueError(f"model.batch_invariant needs the compiled CPU ops (CPU, float32 or bfloat16), got "
                             f"{device.type} {dtype}")
        return 0
    ops = decode_ops()
    if ops is None:
        if batch_invariant:
            raise ValueError("model.batch_invariant needs the compiled CPU ops of cluster/kernels/decode_ops.cpp, "
                             "which did not build here (see the log)")
        return 0
    attached = 0
    for module in model.modules():
        if not hasattr(module, "cpu_ops"):
            continue
        if getattr(module, "head_dim", 0) % ops.head_dim_multiple:  # attention the kernel cannot vectorize
            if batch_invariant:
                raise ValueError(f"model.batch_invariant: head_dim {module.head_dim} is not a multiple of "
                                 f"{ops.head_dim_multiple}, which the compiled attention needs")
            continue
        module.cpu_ops = ops
        if hasattr(module, "cpu_prefill") and dtype == torch.bfloat16:
            module.cpu_prefill = prefill_kernel_for(module.num_heads, module.num_kv_heads, module.head_dim)
        attached += 1
    logger.info("compiled decode ops attached to %d modules", attached)
    return attached
