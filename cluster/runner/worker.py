"""Loading a model onto a device and sizing its KV cache: what a replica's worker does once."""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import torch

from cluster.config import TandemConfig
from cluster.kernels.packed_linear import pack_linears
from cluster.models.layers.cpu_ops import attach_decode_ops
from cluster.models.gguf_blocks import read_blocks
from cluster.models.hf_folder import iter_lazy_weights, iter_weights
from cluster.models.lora import LoRAState, adapter_bytes, attach_lora, load_adapter
from cluster.models.loader import load_hf_config, load_tokenizer_if_present, resolve_model
from cluster.models.registry import build_model, engine_max_model_len, resolve_dtype
from cluster.parallel.group import TPGroup
from cluster.parallel.layers import pack_parallel_linears
from cluster.quant.apply import quantize_linears
from cluster.quant.checkpoint import dequantized, folder_scheme
from cluster.quant.gguf_linear import use_gguf_blocks
from cluster.quant.gguf_rows import choose_gguf_rows
from cluster.runner.attention_choice import choose_attention
from cluster.runner.model_runner import KVCacheSpec, ModelRunner, free_device_memory, num_blocks_for_budget
from cluster.shared.device import default_device

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
        """Load the model of ``config`` in this process. Raises ValueError when
        ``parallel.tensor_parallel_size`` > 1: :func:`cluster.runner.start.start_worker` starts
        the other ranks too."""
        if config.parallel.tensor_parallel_size > 1:
            raise ValueError(f"Worker.from_config loads one process, not tensor_parallel_size "
                             f"{config.parallel.tensor_parallel_size}; use cluster.runner.start.start_worker")
        if config.device.num_threads:
            torch.set_num_threads(config.device.num_threads)
        device = default_device(config.device.device)
        started = time.monotonic()
        loaded = load_model(config, device)
        num_blocks = num_kv_blocks(config, loaded.spec, device, on_demand_lora_bytes(config, loaded))
        runner = ModelRunner(loaded.model, num_blocks, loaded.spec, device, config.model.batch_invariant,
                             config.speculative.verification, config.speculative.method in ("draft", "eagle3"),
                             choose_attention(config, device, loaded.max_model_len), lora=loaded.lora)
        use_step_threads(config, device)
        logger.info(
            "loaded %s (%s, %s) in %.1fs; KV cache: %d blocks of %d tokens",
            config.model.model, loaded.dtype, device, time.monotonic() - started, num_blocks, loaded.spec.block_size,
        )
        return cls(runner, loaded.tokenizer, loaded.hf_config, loaded.max_model_len)

    def close(self) -> None:
        """Release what the worker holds beyond memory (other ranks' processes); idempotent."""


class LoadedModel(NamedTuple):
    model: torch.nn.Module
    hf_config: object
    tokenizer: object
    dtype: torch.dtype
    max_model_len: int
    spec: KVCacheSpec  # this rank's KV heads
    lora: LoRAState | None  # the adapters served beside the model (None: no projection wrapped)


def use_step_threads(config: TandemConfig, device: torch.device) -> None:
    """torch's intra-op threads for the steps to come, once the model is loaded. On an accelerator
    the host only builds each step's small metadata tensors, and some torch CPU ops split even
    those over the whole OpenMP pool (``repeat_interleave`` does), so a step paid an OpenMP
    fork and barrier over every core per op: one thread there, unless ``device.num_threads``
    names more. On the CPU the threads are the compute and stay as they were set."""
    if device.type != "cpu" and not config.device.num_threads:
        torch.set_num_threads(1)


def load_model(config: TandemConfig, device: torch.device, tp: TPGroup | None = None) -> LoadedModel:
    """Build the model of ``config`` on ``device`` and load its weights (with ``tp``, only
    this rank's shard of each split tensor is read)."""
    if tp is not None and (config.model.lora_modules or config.model.lora_dir):
        raise ValueError("the native engine serves LoRA adapters in one process, not split over "
                         f"{tp.world_size} tensor-parallel ranks (a vLLM group serves them split)")
    source = resolve_model(config.model.model, config.model.cache_dir)
    hf_config = load_hf_config(source)
    tokenizer = load_tokenizer_if_present(source)
    dtype = resolve_dtype(config.model.dtype, hf_config, device)
    max_model_len = engine_max_model_len(config.model.max_model_len, hf_config)
    model = build_model(hf_config, dtype, device, max_model_len, tp)
    stored_scheme = folder_scheme(hf_config)
    if stored_scheme is not None and tp is not None:
        raise ValueError(f"{source.path} holds int8 weights; tensor parallelism needs the full-precision model "
                         "(set model.quantization: int8 on it instead)")
    if tp is not None:
        model.load_weights(iter_lazy_weights(source))
    else:
        weights = iter_weights(source)
        model.load_weights(dequantized(weights) if stored_scheme else weights)
    scheme = config.model.quantization if config.model.quantization != "none" else (stored_scheme or "none")
    if scheme == "gguf":
        _use_gguf_blocks(model, source, hf_config, device, tp, config.model.gguf_activations == "int8+residual")
    elif scheme != "none":
        quantize_linears(model, scheme)
    pack_linears(model, device, dtype, config.model.batch_invariant)
    if scheme == "gguf":
        choose_gguf_rows(model, dtype)
    attach_decode_ops(model, device, dtype, config.model.batch_invariant)
    if tp is not None:
        pack_parallel_linears(model, device, dtype)
    on_demand = config.model.max_loras - len(config.model.lora_modules) if config.model.lora_dir else 0
    lora = attach_lora(model, [load_adapter(name, path, model, config.model.max_lora_rank)
                               for name, path in config.model.lora_modules.items()],
                       on_demand, config.model.max_lora_rank)
    cache_dtype = torch.int8 if config.cache.kv_cache_dtype == "int8" else None
    spec = KVCacheSpec(model.num_layers, model.num_kv_heads, model.head_dim, config.cache.block_size, dtype,
                       cache_dtype)
    return LoadedModel(model, hf_config, tokenizer, dtype, max_model_len, spec, lora)


def _use_gguf_blocks(model, source, hf_config, device: torch.device, tp: TPGroup | None, residual: bool) -> None:
    """``model.quantization: gguf``: the linear layers compute from the GGUF file's own blocks on the CPU."""
    if tp is not None:
        raise ValueError("model.quantization: gguf runs in one process, not split over tensor-parallel ranks")
    blocks = read_blocks(source.path)
    if not blocks:
        raise ValueError(f"model.quantization: gguf serves a GGUF file's quantized weights as they are, and "
                         f"{source.name} has none in a served format (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K); "
                         "give a .gguf file or the embedded model, or set model.quantization: none")
    if device.type != "cpu":
        logger.warning("model.quantization: gguf computes from the blocks on the CPU only; on %s the layers "
                       "keep the widened weights", device.type)
        return
    use_gguf_blocks(model, blocks, bool(getattr(hf_config, "tie_word_embeddings", False)), residual)


def on_demand_lora_bytes(config: TandemConfig, loaded: LoadedModel) -> int:
    """Room kept for adapters ``model.lora_dir`` may load: the rest of ``max_loras``, each at
    ``max_lora_rank`` on every projection (0 without a ``lora_dir``)."""
    if config.model.lora_dir is None:
        return 0
    slots = config.model.max_loras - len(config.model.lora_modules)
    return slots * adapter_bytes(loaded.hf_config, config.model.max_lora_rank, loaded.dtype.itemsize)


def num_kv_blocks(config: TandemConfig, spec: KVCacheSpec, device: torch.device, reserved_bytes: int = 0) -> int:
    """The pool size: ``cache.num_blocks``, else what the memory budget of this device holds
    (with no fixed budget, ``kv_cache_fraction`` of its free memory less ``reserved_bytes``, as the
    memory plan counts it)."""
    num_blocks = config.cache.num_blocks
    if num_blocks is None:
        budget = config.cache.memory_bytes()
        if budget is None:
            budget = int((free_device_memory(device) - reserved_bytes) * config.cache.kv_cache_fraction)
        num_blocks = num_blocks_for_budget(spec, budget)
    return num_blocks
