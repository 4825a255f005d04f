"""From a Hugging Face config to one of our model classes."""

from __future__ import annotations

import logging

import torch

from cluster.kernels.packed_linear import onednn_packs
from cluster.models.llama import LlamaForCausalLM
from cluster.models.opt import OPTForCausalLM
from cluster.parallel.group import TPGroup

_ARCHITECTURES = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "opt": OPTForCausalLM,
}

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_class(hf_config) -> type[torch.nn.Module]:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in _ARCHITECTURES:
        raise ValueError(f"model type {model_type!r} is not supported; supported: {sorted(_ARCHITECTURES)}")
    return _ARCHITECTURES[model_type]


def context_length(hf_config) -> int:
    return int(getattr(hf_config, "max_position_embeddings", 2048))


def engine_max_model_len(max_model_len: int | None, hf_config) -> int:
    """The context an engine serves: ``model.max_model_len`` when set, else the model's own.
    Raises ValueError when the setting exceeds the model's context."""
    model_len = context_length(hf_config)
    if max_model_len is not None and max_model_len > model_len:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's context length {model_len}")
    return max_model_len or model_len


def resolve_dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    """The compute dtype for ``name``; float16 is refused on the CPU.

    'auto' serves in a 16-bit type where the device computes it fast, like vLLM's
    'auto': on CUDA the checkpoint's dtype, a float32 checkpoint in bfloat16 (float16 where
    bfloat16 is missing); on the CPU bfloat16 where oneDNN has a native bfloat16 path
    (AVX-512 or AMX), else float32 (on a plain AVX2 CPU bfloat16 matmuls are emulated and
    measured 26x slower than float32 for a decode-sized linear layer).
    """
    if name == "auto":
        return _auto_dtype(hf_config, device)
    if name in DTYPES:
        dtype = DTYPES[name]
    else:
        raise ValueError(f"dtype {name!r} is not supported; use one of {sorted(DTYPES)} or 'auto'")
    if dtype == torch.float16 and device.type == "cpu":
        raise ValueError("float16 is not supported on the CPU; use bfloat16 or float32")
    if dtype == torch.bfloat16 and device.type == "cpu" and not onednn_packs(dtype):
        logger.warning("this CPU has no native bfloat16 matmul (no AVX-512/AMX): bfloat16 runs emulated and "
                       "many times slower than float32; dtype 'auto' picks float32 here")
    return dtype


def _auto_dtype(hf_config, device: torch.device) -> torch.dtype:
    if device.type == "cpu":
        return torch.bfloat16 if onednn_packs(torch.bfloat16) else torch.float32
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if dtype in (torch.bfloat16, torch.float16):
        return dtype
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def build_model(
    hf_config, dtype: torch.dtype, device: torch.device, max_position: int, tp: TPGroup | None = None
) -> torch.nn.Module:
    """An uninitialised model on ``device`` in ``dtype``; call ``load_weights`` next.

    With ``tp``, the model holds this rank's shard of every split layer.
    """
    cls = model_class(hf_config)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(hf_config, max_position) if tp is None else cls(hf_config, max_position, tp)
    finally:
        torch.set_default_dtype(default)
    return model.eval().requires_grad_(False)
