"""Copying Hugging Face checkpoint tensors into our (partly fused) modules."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

# HF projection name -> (our fused parameter name, index of its shard)
StackedParams = dict[str, tuple[str, int]]


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    rename: Callable[[str], str | None],
    stacked: StackedParams,
    shard_sizes: Callable[[str], list[int]],
) -> None:
    """Copy every tensor into its parameter; fused parameters take shards along dim 0.

    ``rename`` maps an HF name to ours (None skips the tensor). Raises ValueError on
    an unexpected name, a wrong shape, or a parameter no tensor filled. A tensor may be
    lazy (``narrow`` and ``full`` read from the file); a parameter with ``tp_load``
    (tensor-parallel layers) takes its own slice of it.
    """
    params = dict(model.named_parameters())
    expected: set[tuple[str, int | None]] = set()
    for name in params:
        fused = {index for part, (fused_name, index) in stacked.items() if f".{fused_name}." in f".{name}"}
        expected |= {(name, i) for i in fused} if fused else {(name, None)}
    loaded: set[tuple[str, int | None]] = set()
    for hf_name, tensor in weights:
        name = rename(hf_name)
        if name is None:
            continue
        target, shard = name, None
        for part, (fused_name, index) in stacked.items():
            if f".{part}." in f".{name}":
                target, shard = name.replace(f"{part}.", f"{fused_name}.", 1), index
                break
        if target not in params:
            raise ValueError(f"unexpected weight {hf_name!r} for {type(model).__name__}")
        param = params[target]
        tp_load = getattr(param, "tp_load", None)
        if tp_load is not None:  # a tensor-parallel parameter copies its own slice
            tp_load(tensor, shard)
            loaded.add((target, shard))
            continue
        if not isinstance(tensor, torch.Tensor):  # a lazily read checkpoint tensor: all of it
            tensor = tensor.full()
        if shard is not None:
            sizes = shard_sizes(target)
            param = param.narrow(0, sum(sizes[:shard]), sizes[shard])
        if param.shape != tensor.shape:
            raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor.to(param.dtype))
        loaded.add((target, shard))
    missing = expected - loaded
    if missing:
        names = sorted(n for n, _ in missing)
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors, e.g. {names[:3]}")
