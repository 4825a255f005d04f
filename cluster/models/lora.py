"""LoRA adapters served beside their base model: many adapters, one copy of the base weights.

An adapter is a folder as PEFT saves it (``adapter_config.json`` and
``adapter_model.safetensors``): per targeted projection, ``lora_A`` ([r, in]) and ``lora_B``
([out, r]), and the output gains ``scale * B @ A @ x`` with ``scale = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with rsLoRA). Targets are the Llama family's projections (``q_proj``,
``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``); what PEFT can
save beyond them (DoRA, biases, embeddings, the LM head, ``modules_to_save``) is refused by
name when the adapter loads.

``attach_lora`` wraps each targeted projection of the model in a ``LoRALinear``; a step's
tokens say which adapter each one runs with (``LoRABatch``, slot 0: none), so one batch mixes
requests of any adapters and of the base model. A step with no adapter runs the base model
alone, exactly as without adapters.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from cluster.models.llama import LlamaForCausalLM

# PEFT's module name -> (the fused projection of Tandem's Llama layer, the part of it)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}
TARGETS = tuple(_FUSED)  # the projections an adapter may target
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot be served; the message says which and why."""


@dataclass
class LoRAAdapter:
    """One loaded adapter: per (layer, PEFT module name), A [r, in] and B [out, r] with the scale folded in."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def load_adapter(name: str, path: str | Path, model: nn.Module, max_rank: int) -> LoRAAdapter:
    """Read a PEFT adapter folder for ``model``; LoRAError names what cannot be served."""
    if not isinstance(model, LlamaForCausalLM):
        raise LoRAError(f"LoRA adapters are served for Llama-family models, not {type(model).__name__}")
    hf_config = model.config
    folder = Path(path)
    where = f"LoRA adapter {name!r} ({folder})"
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise LoRAError(f"{where}: expected adapter_config.json and adapter_model.safetensors, as PEFT saves them")
    settings = json.loads(config_file.read_text())
    if settings.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{where}: peft_type is {settings.get('peft_type')!r}; only LORA adapters are served")
    for key, allowed in (("use_dora", (False, None)), ("bias", ("none", None)), ("modules_to_save", (None, [])),
                         ("fan_in_fan_out", (False, None))):
        if settings.get(key) not in allowed:
            raise LoRAError(f"{where}: {key}={settings.get(key)!r} is not supported")
    rank = settings.get("r")
    if not isinstance(rank, int) or not 0 < rank <= max_rank:
        raise LoRAError(f"{where}: rank r={rank!r} must be between 1 and model.max_lora_rank ({max_rank})")
    if settings.get("rank_pattern") or settings.get("alpha_pattern"):
        raise LoRAError(f"{where}: per-module ranks or alphas (rank_pattern, alpha_pattern) are not supported")
    alpha = settings.get("lora_alpha", rank)
    scale = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    tensors = load_file(str(weights_file))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in _FUSED:
            raise LoRAError(f"{where}: tensor {key!r} is not a LoRA weight of a supported projection "
                            f"({', '.join(TARGETS)})")
        layer, module, part = int(match.group(1)), match.group(2), match.group(3)
        pairs.setdefault((layer, module), {})[part] = tensor
    if not pairs:
        raise LoRAError(f"{where}: no LoRA weights in {weights_file.name}")
    adapter = LoRAAdapter(name, str(folder), rank)
    for (layer, module), parts in pairs.items():
        if set(parts) != {"A", "B"}:
            raise LoRAError(f"{where}: layer {layer} {module} has lora_{''.join(parts)} without its pair")
        a, b = parts["A"], parts["B"]
        expected_in, expected_out = projection_shape(hf_config, module)
        if layer >= hf_config.num_hidden_layers or a.shape != (rank, expected_in) or b.shape != (expected_out, rank):
            raise LoRAError(f"{where}: layer {layer} {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; this "
                            f"model needs A ({rank}, {expected_in}) and B ({expected_out}, {rank}) in "
                            f"{hf_config.num_hidden_layers} layers")
        adapter.weights[(layer, module)] = (a.float(), b.float() * scale)
    return adapter


def projection_shape(hf_config, module: str) -> tuple[int, int]:
    """(in, out) features of a Llama-family projection."""
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * head_dim, hf_config.num_key_value_heads * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}[module]


@dataclass(frozen=True)
class LoRABatch:
    """Which adapter slot each token of a step runs with: per slot present, its tokens' rows, a
    slice when they are consecutive (the runner orders a step's requests by adapter so they are),
    else their indices."""

    groups: tuple[tuple[int, slice | torch.Tensor], ...]

    @classmethod
    def from_token_slots(cls, slots: list[int], counts: list[int], device: torch.device) -> "LoRABatch | None":
        """``slots[i]`` for ``counts[i]`` consecutive tokens; None when no token has an adapter."""
        runs: list[tuple[int, int, int]] = []  # (slot, first row, end row), consecutive chunks merged
        row = 0
        for slot, count in zip(slots, counts):
            if count and runs and runs[-1][0] == slot and runs[-1][2] == row:
                runs[-1] = (slot, runs[-1][1], row + count)
            elif count:
                runs.append((slot, row, row + count))
            row += count
        present = [run for run in runs if run[0]]
        if not present:
            return None
        if len({slot for slot, _, _ in present}) == len(present):
            return cls(tuple((slot, slice(first, end)) for slot, first, end in present))
        per_token = torch.tensor(slots, device=device).repeat_interleave(torch.tensor(counts, device=device))
        return cls(tuple((slot, (per_token == slot).nonzero().squeeze(1))
                         for slot in sorted({slot for slot, _, _ in present})))


class LoRAState:
    """The adapters an engine serves (slot i + 1 holds adapter i) and the step's batch, read by
    every ``LoRALinear`` of the model."""

    def __init__(self, adapters: list[LoRAAdapter]) -> None:
        self.slots = {adapter.name: index + 1 for index, adapter in enumerate(adapters)}
        self.batch: LoRABatch | None = None


class LoRALinear(nn.Module):
    """A projection (fused or not) plus, per adapter slot, its low-rank update: ``out += (x @ A.T) @ B.T``
    with the A of every targeted part stacked ([sum r, in]) and their B placed block-diagonally in the
    parts' columns ([out, sum r], zero for a part the adapter does not target), two matmuls per slot."""

    def __init__(self, base: nn.Module, part_sizes: list[int], state: LoRAState) -> None:
        super().__init__()
        self.base = base
        self.state = state
        self.offsets = [sum(part_sizes[:i]) for i in range(len(part_sizes))]
        self.sizes = part_sizes
        self.updates: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # slot -> (A, B)

    def add(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]], device, dtype) -> None:
        rank_total = sum(a.shape[0] for a, _ in parts.values())
        b_full = torch.zeros(sum(self.sizes), rank_total)
        a_rows, row = [], 0
        for part, (a, b) in sorted(parts.items()):
            a_rows.append(a)
            b_full[self.offsets[part]:self.offsets[part] + self.sizes[part], row:row + a.shape[0]] = b
            row += a.shape[0]
        self.updates[slot] = (torch.cat(a_rows).to(device=device, dtype=dtype), b_full.to(device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        batch = self.state.batch
        if batch is None:
            return out
        for slot, rows in batch.groups:
            update = self.updates.get(slot)
            if update is None:
                continue
            a, b = update
            if isinstance(rows, slice):
                out[rows].addmm_(x[rows] @ a.t(), b.t())
            else:
                out.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())
        return out


def attach_lora(model: nn.Module, adapters: list[LoRAAdapter]) -> LoRAState:
    """Wrap every projection an adapter targets; the model then reads ``state.batch`` each step."""
    state = LoRAState(adapters)
    if not adapters:
        return state
    if not isinstance(model, LlamaForCausalLM):
        raise LoRAError(f"LoRA adapters are served for Llama-family models, not {type(model).__name__}")
    layers = model.layers
    weight = model.embed_tokens.weight  # the model's device and dtype
    for index, layer in enumerate(layers):
        sizes = {"qkv_proj": [layer.q_size, layer.kv_size, layer.kv_size], "o_proj": [model.config.hidden_size],
                 "gate_up_proj": [layer.intermediate_size] * 2, "down_proj": [model.config.hidden_size]}
        wrapped: dict[str, LoRALinear] = {}
        for adapter in adapters:
            per_module: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
            for (layer_index, module), pair in adapter.weights.items():
                if layer_index == index:
                    fused, part = _FUSED[module]
                    per_module.setdefault(fused, {})[part] = pair
            for fused, parts in per_module.items():
                if fused not in wrapped:
                    wrapped[fused] = LoRALinear(getattr(layer, fused), sizes[fused], state)
                wrapped[fused].add(state.slots[adapter.name], parts, weight.device, weight.dtype)
        for fused, module in wrapped.items():
            setattr(layer, fused, module)
    return state
