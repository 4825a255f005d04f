"""From a Hugging Face config to one of our model classes."""

from __future__ import annotations

import torch

from cluster.models.llama import LlamaForCausalLM
from cluster.models.opt import OPTForCausalLM

_ARCHITECTURES = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "opt": OPTForCausalLM,
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_class(hf_config) -> type[torch.nn.Module]:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in _ARCHITECTURES:
        raise ValueError(f"model type {model_type!r} is not supported; supported: {sorted(_ARCHITECTURES)}")
    return _ARCHITECTURES[model_type]


def context_length(hf_config) -> int:
    return int(getattr(hf_config, "max_position_embeddings", 2048))


def resolve_dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    """'auto' takes the checkpoint's dtype; float16 is refused where the device lacks it."""
    if name == "auto":
        dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    elif name in DTYPES:
        dtype = DTYPES[name]
    else:
        raise ValueError(f"dtype {name!r} is not supported; use one of {sorted(DTYPES)} or 'auto'")
    if dtype == torch.float16 and device.type == "cpu":
        raise ValueError("float16 is not supported on the CPU; use bfloat16 or float32")
    return dtype


def build_model(hf_config, dtype: torch.dtype, device: torch.device, max_position: int) -> torch.nn.Module:
    """An uninitialised model on ``device`` in ``dtype``; call ``load_weights`` next."""
    cls = model_class(hf_config)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(hf_config, max_position)
    finally:
        torch.set_default_dtype(default)
    return model.eval().requires_grad_(False)
