"""Loading a model onto a device and sizing its KV cache: what a replica's worker does once."""

from __future__ import annotations

import logging
import time

import torch

from cluster.config import TandemConfig
from cluster.models.loader import iter_weights, load_hf_config, load_tokenizer_if_present, resolve_model
from cluster.models.layers.packed_linear import pack_linears
from cluster.models.registry import build_model, context_length, resolve_dtype
from cluster.runner.model_runner import KVCacheSpec, ModelRunner, free_device_memory, num_blocks_for_budget

logger = logging.getLogger(__name__)



class Worker:
    def __init__(self, runner: ModelRunner, tokenizer, hf_config, max_model_len: int) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.hf_config = hf_config
        self.max_model_len = max_model_len
        self.vocab_size = runner.model.vocab_size
        eos = getattr(hf_config, "eos_token_id", None)
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        if eos is None and tokenizer is not None:
            eos = tokenizer.eos_token_id
        self.eos_token_id = eos

    @classmethod
    def from_config(cls, config: TandemConfig) -> "Worker":
        from cluster.engine.engine import default_device

        if config.device.num_threads:
            torch.set_num_threads(config.device.num_threads)
        device = default_device(config.device.device)
        started = time.monotonic()
        source = resolve_model(config.model.model, config.model.cache_dir)
        hf_config = load_hf_config(source)
        tokenizer = load_tokenizer_if_present(source)
        dtype = resolve_dtype(config.model.dtype, hf_config, device)
        max_model_len = config.model.max_model_len or context_length(hf_config)
        if max_model_len > context_length(hf_config):
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's context length {context_length(hf_config)}"
            )
        model = build_model(hf_config, dtype, device, max_model_len)
        model.load_weights(iter_weights(source))
        pack_linears(model, device, dtype)
        spec = KVCacheSpec(model.num_layers, model.num_kv_heads, model.head_dim, config.cache.block_size, dtype)
        num_blocks = config.cache.num_blocks
        if num_blocks is None:
            budget = config.cache.memory_bytes()
            if budget is None:
                budget = int(free_device_memory(device) * config.cache.kv_cache_fraction)
            num_blocks = num_blocks_for_budget(spec, budget)
        runner = ModelRunner(model, num_blocks, spec, device)
        logger.info(
            "loaded %s (%s, %s) in %.1fs; KV cache: %d blocks of %d tokens",
            config.model.model, dtype, device, time.monotonic() - started, num_blocks, spec.block_size,
        )
        return cls(runner, tokenizer, hf_config, max_model_len)
