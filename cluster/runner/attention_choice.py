"""Which attention path a model runner takes on its device (``model.attention``)."""

from __future__ import annotations

import logging

import torch

from cluster.config import TandemConfig
from cluster.models.layers.flex_paged import flex_unavailable

logger = logging.getLogger(__name__)


def choose_attention(config: TandemConfig, device: torch.device) -> str:
    """``gather`` or ``flex``. ``auto`` takes flex on CUDA unless the KV cache is int8 or the
    model batch-invariant (which only the gathering path serves), gather elsewhere. Raises
    ValueError when flex is asked for where it cannot run (never a quiet switch)."""
    choice = config.model.attention
    if choice == "auto":
        plain = config.cache.kv_cache_dtype == "auto" and not config.model.batch_invariant
        choice = "flex" if device.type == "cuda" and plain else "gather"
        if choice == "flex" and flex_unavailable(device) is not None:
            raise ValueError(f"{flex_unavailable(device)} (model.attention auto picks flex on CUDA; "
                             "set model.attention: gather to serve without it)")
        logger.info("model.attention auto: %s on %s", choice, device)
    elif choice == "flex" and (reason := flex_unavailable(device)) is not None:
        raise ValueError(reason)
    return choice
