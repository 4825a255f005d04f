"""LoRA adapters' memory on each rank of a group, for the memory plan.

The native engine holds each adapter at its own size (``cluster/models/lora.py`` keeps no
padding): per layer and targeted projection, ``r x (in + out)`` values in the model's dtype,
``r`` and the targets read from the adapter's ``adapter_config.json``. An adapter whose folder is
not readable where the plan is made (a path on the serving nodes) is counted at
``model.max_lora_rank`` on every projection, and the plan says so. With ``model.lora_dir``, the
rest of ``model.max_loras`` is counted as adapters at ``max_lora_rank`` on every projection: the
most that adapters loaded on demand can take.

vLLM allocates its LoRA buffers at start-up for ``max_loras`` adapters (Tandem sets it to the
number of adapters, or to ``model.max_loras`` with a ``lora_dir``) at ``max_lora_rank`` on every projection, whatever the adapters hold; a
column-parallel projection (q, k, v, gate, up) splits its ``B`` over the tensor-parallel ranks, a
row-parallel one (o, down) its ``A``.
"""

from __future__ import annotations

import json
from pathlib import Path

from cluster.config import TandemConfig
from cluster.models.lora import TARGETS, projection_features
from cluster.planning.model_shapes import ModelShape

_ROW_PARALLEL = ("o_proj", "down_proj")


def _features(shape: ModelShape, module: str) -> tuple[int, int]:
    return projection_features(shape.hidden_size, shape.intermediate_size, shape.num_heads * shape.head_dim,
                               shape.num_kv_heads * shape.head_dim, module)


def _per_rank_values(shape: ModelShape, rank: int, targets, tp: int) -> int:
    """Values of one adapter of rank ``rank`` on ``targets`` in every layer, on one of ``tp`` ranks."""
    total = 0
    for module in targets:
        fan_in, fan_out = _features(shape, module)
        total += rank * (fan_in // tp + fan_out if module in _ROW_PARALLEL else fan_in + fan_out // tp)
    return total * shape.num_layers


def _declared(path: str) -> tuple[int, list[str]] | None:
    """(r, targets) from an adapter folder's adapter_config.json; None when it cannot be read here."""
    try:
        settings = json.loads((Path(path).expanduser() / "adapter_config.json").read_text())
        rank, targets = int(settings["r"]), settings.get("target_modules") or list(TARGETS)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if isinstance(targets, str):  # PEFT also takes a regular expression: count every projection
        targets = list(TARGETS)
    return rank, [t for t in targets if t in TARGETS]


def lora_bytes(config: TandemConfig, shape: ModelShape, dtype_bytes: int, tp: int, vllm: bool) -> tuple[int, str | None]:
    """Bytes of the group's adapters on one rank, and a note for the plan (None without adapters)."""
    adapters, lora_dir = config.model.lora_modules, config.model.lora_dir
    if not adapters and lora_dir is None:
        return 0, None
    max_rank = config.model.max_lora_rank
    on_demand = config.model.max_loras - len(adapters) if lora_dir is not None else 0
    if vllm:
        count = len(adapters) + on_demand
        values = count * _per_rank_values(shape, max_rank, TARGETS, tp)
        return values * dtype_bytes, (f"LoRA: vLLM's buffers for {count} adapters at max_lora_rank "
                                      f"{max_rank} on every projection")
    values, unread = 0, []
    for name, path in adapters.items():
        declared = _declared(path)
        if declared is None:
            unread.append(name)
            declared = (max_rank, list(TARGETS))
        values += _per_rank_values(shape, *declared, tp)
    values += on_demand * _per_rank_values(shape, max_rank, TARGETS, tp)
    note = f"LoRA: {len(adapters)} adapters, each at its own rank and targets"
    if on_demand:
        note += f", and room for {on_demand} from model.lora_dir at max_lora_rank {max_rank} on every projection"
    if unread:
        note += (f"; {', '.join(unread)} not readable here (no adapter_config.json): counted at max_lora_rank "
                 f"{max_rank} on every projection")
    return values * dtype_bytes, note
