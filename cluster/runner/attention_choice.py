"""Which attention path a model runner takes on its device (``model.attention``), and whether
its decode and verify steps replay CUDA graphs (``model.enforce_eager``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from cluster.config import TandemConfig
from cluster.models.layers.flex_paged import FlexLayout, flex_unavailable
from cluster.runner.decode_graphs import decode_buckets, query_buckets, verify_buckets

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionPlan:
    path: str = "gather"  # gather | flex
    table_width: int = 0  # flex: block-table columns of every step (0: each step's widest table)
    decode_buckets: tuple[int, ...] = ()  # flex on CUDA: decode batch sizes padded to these
    verify_buckets: tuple[int, ...] = ()  # flex on CUDA with speculation: verify batch sizes padded to these
    query_buckets: tuple[int, ...] = ()  # ... and each sequence's token plus drafts padded to one of these
    cuda_graphs: bool = False  # capture each bucket as a CUDA graph

    def layout(self, num_blocks: int) -> FlexLayout:
        """The flex shapes over a cache of ``num_blocks`` blocks."""
        return FlexLayout(num_blocks, self.table_width, self.decode_buckets, self.verify_buckets, self.query_buckets)


def choose_attention(config: TandemConfig, device: torch.device, max_model_len: int,
                     tensor_parallel: bool = False) -> AttentionPlan:
    """``auto`` takes flex on CUDA unless the KV cache is int8 or the model batch-invariant
    (which only the gathering path serves), gather elsewhere. On CUDA the flex path pads
    decode steps, and with speculation the verify steps of small batches, to buckets (fixed
    shapes for the compiled kernel) and, unless ``enforce_eager`` or tensor-parallel, captures
    them as CUDA graphs. Raises ValueError when
    flex is asked for where it cannot run (never a quiet switch)."""
    choice = config.model.attention
    block_size = config.cache.block_size
    if choice == "auto":
        plain = config.cache.kv_cache_dtype == "auto" and not config.model.batch_invariant
        choice = "flex" if device.type == "cuda" and plain else "gather"
        if choice == "flex" and (reason := flex_unavailable(device, block_size)) is not None:
            raise ValueError(f"{reason} (model.attention auto picks flex on CUDA; set model.attention: gather "
                             "to serve without it)")
    elif choice == "flex" and (reason := flex_unavailable(device, block_size)) is not None:
        raise ValueError(reason)
    if choice == "gather":
        return AttentionPlan()
    width = -(-max_model_len // block_size)
    if device.type != "cuda":
        return AttentionPlan("flex", width)
    graphs = not config.model.enforce_eager and not tensor_parallel
    if tensor_parallel and not config.model.enforce_eager:
        logger.info("tensor-parallel ranks run decode steps without CUDA graphs")
    max_seqs, speculative = config.scheduler.max_num_seqs, config.speculative
    max_k = speculative.num_speculative_tokens if speculative.method != "none" else 0
    plan = AttentionPlan("flex", width, decode_buckets(max_seqs), verify_buckets(max_seqs) if max_k else (),
                         query_buckets(max_k), graphs)
    logger.info("attention: flex, decode buckets %s, verify buckets %s x %s queries, CUDA graphs %s",
                plan.decode_buckets, plan.verify_buckets, plan.query_buckets, "on" if graphs else "off")
    return plan
