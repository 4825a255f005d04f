"""Int8 model folders: what `tandem draft quantize` writes and the loader reads back.

A folder is a Hugging Face folder whose ``config.json`` carries
``"tandem_quantization": {"scheme": "int8" | "int8-dynamic"}``; every quantized
``X.weight`` is stored as int8 next to ``X.weight_scale`` (float32, one per output
row: ``W ~= weight * weight_scale[:, None]``). Everything else (embedding, norms,
biases) keeps its dtype. Loading widens the int8 weights back (:func:`dequantized`),
and the worker quantizes the model again: symmetric per-row int8 of a matrix that is
already on the int8 grid gives back the same int8 values (within float rounding of
the scales), so the layers end up as written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors.torch import save_file

from cluster.quant.int8_linear import QuantizedWeight, dequantize_weight, quantize_weight

CONFIG_KEY = "tandem_quantization"
SCALE_SUFFIX = "_scale"


def folder_scheme(hf_config) -> str | None:
    """The scheme a folder was written with, or None for a full-precision folder."""
    meta = getattr(hf_config, CONFIG_KEY, None)
    if meta is None:
        return None
    return meta["scheme"] if isinstance(meta, dict) else getattr(meta, "scheme")


def dequantized(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Pair each int8 ``X.weight`` with its ``X.weight_scale`` and yield it widened to float32;
    other tensors pass through. Raises ValueError for an int8 weight without a scale."""
    pending: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(SCALE_SUFFIX):
            base = name[: -len(SCALE_SUFFIX)]
            if base in pending:
                yield base, dequantize_weight(QuantizedWeight(pending.pop(base), tensor), torch.float32)
            else:
                scales[base] = tensor
        elif tensor.dtype == torch.int8:
            if name in scales:
                yield name, dequantize_weight(QuantizedWeight(tensor, scales.pop(name)), torch.float32)
            else:
                pending[name] = tensor
        else:
            yield name, tensor
    if pending:
        raise ValueError(f"int8 weights without a {SCALE_SUFFIX} tensor: {', '.join(sorted(pending)[:5])}")


def is_quantizable(name: str, tensor: torch.Tensor) -> bool:
    """The matrices of linear layers (and an untied LM head); not embeddings or norms."""
    return tensor.dim() == 2 and name.endswith(".weight") and "embed" not in name


def write_int8_folder(source: Path, weights: Iterable[tuple[str, torch.Tensor]], out: Path, scheme: str) -> dict:
    """Write ``out`` from ``source`` (a Hugging Face folder): the same config (plus the
    scheme), tokenizer and generation files, and the weights with every linear-layer
    matrix in int8. Returns a summary: tensors quantized and bytes before/after."""
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    bytes_before = bytes_after = num_quantized = 0
    for name, tensor in weights:
        bytes_before += tensor.numel() * tensor.element_size()
        if is_quantizable(name, tensor):
            q = quantize_weight(tensor)
            tensors[name], tensors[name + SCALE_SUFFIX] = q.weight_int8, q.scale
            num_quantized += 1
        else:
            tensors[name] = tensor.contiguous()
        bytes_after += sum(t.numel() * t.element_size() for n, t in tensors.items()
                           if n == name or n == name + SCALE_SUFFIX)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config[CONFIG_KEY] = {"scheme": scheme, "format": "symmetric int8, one float32 scale per output row"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json",) \
                and not path.name.endswith(".index.json"):
            shutil.copy2(path, out / path.name)
    return {"num_quantized": num_quantized, "bytes_before": bytes_before, "bytes_after": bytes_after}
