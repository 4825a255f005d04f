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
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from cluster.models.llama import LlamaForCausalLM
from cluster.models.lora_stack import PartStack

# PEFT's module name -> (the fused projection of Tandem's Llama layer, the part of it)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}
TARGETS = tuple(_FUSED)  # the projections an adapter may target
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot be served; the message says which and why."""


@dataclass
class LoRAAdapter:
    """One loaded adapter: per (layer, PEFT module name), A [r, in] and B [out, r] with the scale
    folded in, in the model's dtype, on the host (B a transposed view of a contiguous [r, out])."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def load_adapter(name: str, path: str | Path, model: nn.Module, max_rank: int) -> LoRAAdapter:
    """Read a PEFT adapter folder for ``model``; LoRAError names what cannot be served."""
    if not isinstance(model, LlamaForCausalLM):
        raise LoRAError(f"LoRA adapters are served for Llama-family models, not {type(model).__name__}")
    hf_config = model.config
    weight = model.embed_tokens.weight  # the model's dtype
    folder = Path(path)
    where = f"LoRA adapter {name!r} ({folder})"
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise LoRAError(f"{where}: expected adapter_config.json and adapter_model.safetensors, as PEFT saves them")
    try:
        settings = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise LoRAError(f"{where}: adapter_config.json cannot be read: {err}") from None
    if not isinstance(settings, dict):
        raise LoRAError(f"{where}: adapter_config.json holds {type(settings).__name__}, not PEFT's settings object")
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
    try:
        tensors = load_file(str(weights_file))
    except (OSError, SafetensorError) as err:
        raise LoRAError(f"{where}: {weights_file.name} cannot be read: {err}") from None
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
        # In the model's dtype, B laid out transposed (as a stack holds it), so stacking between
        # two steps is plain copies: the reading thread does the rest. Kept on the host until
        # stacked (an adapter read may wait for room; device memory holds only the stacks).
        b = (b.float() * scale).t().contiguous().to(dtype=weight.dtype).t()
        adapter.weights[(layer, module)] = (a.to(dtype=weight.dtype), b)
    return adapter


def projection_features(hidden: int, intermediate: int, q_size: int, kv_size: int, module: str) -> tuple[int, int]:
    """(in, out) features of a Llama-family projection, from the layer's sizes."""
    return {"q_proj": (hidden, q_size), "k_proj": (hidden, kv_size), "v_proj": (hidden, kv_size),
            "o_proj": (q_size, hidden), "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate),
            "down_proj": (intermediate, hidden)}[module]


def projection_shape(hf_config, module: str) -> tuple[int, int]:
    """(in, out) features of a Llama-family projection of a transformers config."""
    hidden = hf_config.hidden_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    return projection_features(hidden, hf_config.intermediate_size, hf_config.num_attention_heads * head_dim,
                               hf_config.num_key_value_heads * head_dim, module)


def adapter_bytes(hf_config, rank: int, element_size: int) -> int:
    """The most one adapter of rank ``rank`` can take: every projection of every layer."""
    features = sum(sum(projection_shape(hf_config, module)) for module in TARGETS)
    return rank * features * hf_config.num_hidden_layers * element_size


@dataclass
class LoRABatch:
    """Which adapter slot each token of a step runs with. When the adapter tokens are one run of
    rows of one adapter (the runner orders a step's requests by adapter), ``run`` slices them;
    otherwise ``token_slots`` holds every token's slot, and each projection computes the update
    of every adapter present for every row at once, keeping each row's own (``mask``).
    ``every_row`` (a CUDA graph's step, :meth:`static`): the same over every row of every
    stack, whichever adapters the tensor ``token_slots`` will name when the graph replays."""

    present: tuple[int, ...]  # the adapter slots with tokens in this step, ascending
    num_tokens: int
    run: tuple[int, slice] | None = None
    token_slots: torch.Tensor | None = None  # [num_tokens] when run is None
    every_row: bool = False
    _masks: dict = field(default_factory=dict, repr=False)

    @classmethod
    def static(cls, token_slots: torch.Tensor) -> "LoRABatch":
        """A step whose token slots are read from ``token_slots`` when it runs (0: no adapter);
        its projections read whole stacks, reserved (``LoRAState.reserve``) so they never move."""
        return cls((), token_slots.shape[0], token_slots=token_slots, every_row=True)

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
        slots_present = tuple(sorted({slot for slot, _, _ in present}))
        if len(present) == 1:
            slot, first, end = present[0]
            return cls(slots_present, row, run=(slot, slice(first, end)))
        per_token = [slot for slot, count in zip(slots, counts) for _ in range(count)]
        return cls(slots_present, row, token_slots=torch.tensor(per_token, dtype=torch.int64).to(device))

    def mask(self, column_slots: torch.Tensor, key, dtype: torch.dtype) -> torch.Tensor:
        """[num_tokens, columns]: 1 where a column (a rank of some adapter) is the token's adapter's,
        else 0; made once per step for every projection whose present adapters' columns are ``key``."""
        held = self._masks.get(key)
        if held is None:
            held = self._masks[key] = (self.token_slots[:, None] == column_slots[None, :]).to(dtype)
        return held


class LoRAState:
    """The adapters an engine serves and the step's batch, read by every ``LoRALinear`` of the model.

    Each adapter added gets the next slot (1, 2, ...; slot 0 is the base model), never one used
    before, so a projection's columns stay in slot order as adapters come and go."""

    def __init__(self, modules: list[dict[str, "LoRALinear"]], device: torch.device, dtype: torch.dtype) -> None:
        self.slots: dict[str, int] = {}
        self.batch: LoRABatch | None = None
        self.modules = modules  # per layer: fused projection name -> its wrapper
        self.device, self.dtype = device, dtype
        self._next_slot = 1

    def add(self, adapter: LoRAAdapter) -> int:
        """Stack ``adapter`` onto the wrapped projections it targets; its slot."""
        if adapter.name in self.slots:
            raise ValueError(f"LoRA adapter {adapter.name!r} is already loaded")
        per_module: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, module), pair in adapter.weights.items():
            fused, part = _FUSED[module]
            if fused not in self.modules[layer]:
                raise LoRAError(f"LoRA adapter {adapter.name!r} targets {module} of layer {layer}, which no adapter "
                                "loaded at start targets (model.lora_dir wraps every projection)")
            per_module.setdefault((layer, fused), {})[part] = pair
        slot, self._next_slot = self._next_slot, self._next_slot + 1
        for (layer, fused), parts in per_module.items():
            self.modules[layer][fused].add(slot, parts, self.device, self.dtype)
        self.slots[adapter.name] = slot
        return slot

    def remove(self, name: str) -> None:
        """Drop an adapter's columns from every projection (no step may be running)."""
        slot = self.slots.pop(name)
        for layer in self.modules:
            for module in layer.values():
                module.remove(slot)

    def reserve(self) -> None:
        """Allocate every stack at its capacity, once: adapters added or removed later are written
        into the same tensors (what a CUDA graph captured over them needs)."""
        for layer in self.modules:
            for module in layer.values():
                module.reserve(self.device, self.dtype)


class LoRALinear(nn.Module):
    """A projection (fused or not) plus, per adapter slot, its low-rank update on each part it
    targets: ``out[:, part] += (x @ A.T) @ B.T``.

    Each part keeps its adapters stacked (``PartStack``). A step of one adapter's run of rows
    takes that adapter's columns (two matmuls per part on those rows); a step mixing adapters takes
    the columns from the first adapter present to the last, for every row, with each row's other
    adapters' ranks masked out: two matmuls and a multiply per part, whatever the number of
    adapters. Parts never hold another part's zeros: a decode step reads each adapter's weights
    once, and its cost is those bytes. A CUDA graph's step (``LoRABatch.every_row``) reads every
    part's whole stack, so it costs the capacity's bytes, whatever is loaded."""

    def __init__(self, base: nn.Module, part_sizes: list[int], in_features: int, capacities: list[int],
                 state: LoRAState) -> None:
        """``capacities``: per part, the most adapter rows it may hold (``PartStack``)."""
        super().__init__()
        self.base = base
        self.state = state
        self.parts = [PartStack(sum(part_sizes[:i]), size, in_features, capacity)
                      for i, (size, capacity) in enumerate(zip(part_sizes, capacities))]
        self.last_slot = 0
        self.a = self.column_slots = None  # every part's A and row slots, once reserved

    def add(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]], device, dtype) -> None:
        """Stack ``slot``'s update (per part index, A [r, in] and B [part size, r]) after those added before."""
        if slot <= self.last_slot:
            raise ValueError(f"LoRA slot {slot} added after slot {self.last_slot}")
        self.last_slot = slot
        for part, (a, b) in sorted(parts.items()):
            self.parts[part].add(slot, a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))

    def remove(self, slot: int) -> None:
        for part in self.parts:
            part.remove(slot)

    def reserve(self, device: torch.device, dtype: torch.dtype) -> None:
        """Reserve the parts' stacks with their A and row slots in one tensor each, parts one
        after the other, so a CUDA graph's step multiplies and masks them all at once."""
        rows = sum(part.capacity for part in self.parts)
        self.a = torch.zeros(rows, self.parts[0].in_features, dtype=dtype, device=device)
        self.column_slots = torch.full((rows,), -1, dtype=torch.int64, device=device)
        start = 0
        for part in self.parts:
            end = start + part.capacity
            part.reserve(device, dtype, self.a[start:end], self.column_slots[start:end])
            start = end

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        batch = self.state.batch
        if batch is None:
            return out
        if batch.every_row:  # reserved: one product and one mask over every part's rows
            mine = batch.token_slots[:, None] == self.column_slots[None, :]
            shrunk = torch.where(mine, x @ self.a.t(), 0)
            start = 0
            for part in self.parts:
                if part.capacity:
                    end = start + part.capacity
                    out[:, part.offset:part.end].addmm_(shrunk[:, start:end], part.bt)
                    start = end
            return out
        if batch.run is not None:
            slot, rows = batch.run
            for part in self.parts:
                if slot in part.columns:
                    start, end = part.columns[slot]
                    out[rows, part.offset:part.end].addmm_(x[rows] @ part.a[start:end].t(), part.bt[start:end])
            return out
        n = batch.num_tokens
        for part in self.parts:
            spans = tuple((slot, part.columns[slot]) for slot in batch.present if slot in part.columns)
            if not spans:
                continue
            start, end = spans[0][1][0], spans[-1][1][1]
            # Parts whose present adapters sit in the same columns share a mask (columns of
            # adapters absent from the step are zero in it, whichever adapter they are).
            mask = batch.mask(part.column_slots[start:end], spans, x.dtype)
            out[:n, part.offset:part.end].addmm_((x[:n] @ part.a[start:end].t()).mul_(mask), part.bt[start:end])
        return out


def attach_lora(model: nn.Module, adapters: list[LoRAAdapter], on_demand: int = 0,
                max_rank: int = 0) -> LoRAState | None:
    """Wrap every projection an adapter targets and add ``adapters``; the model then reads
    ``state.batch`` each step. ``on_demand``: how many adapters of rank up to ``max_rank`` may be
    added later (``model.lora_dir``), any projection of any layer, so then all seven of every layer
    are wrapped, with that room in their capacity. None when there is nothing to wrap."""
    if not adapters and not on_demand:
        return None
    if not isinstance(model, LlamaForCausalLM):
        raise LoRAError(f"LoRA adapters are served for Llama-family models, not {type(model).__name__}")
    weight = model.embed_tokens.weight  # the model's device and dtype
    state = LoRAState([], weight.device, weight.dtype)
    ranks: dict[tuple[int, str, int], int] = {}  # (layer, fused projection, part) -> rows its adapters take
    for adapter in adapters:
        for layer, module in adapter.weights:
            key = (layer, *_FUSED[module])
            ranks[key] = ranks.get(key, 0) + adapter.rank
    room = on_demand * max_rank
    hidden = model.config.hidden_size
    for index, layer in enumerate(model.layers):
        shapes = {"qkv_proj": ([layer.q_size, layer.kv_size, layer.kv_size], hidden),
                  "o_proj": ([hidden], layer.q_size), "gate_up_proj": ([layer.intermediate_size] * 2, hidden),
                  "down_proj": ([hidden], layer.intermediate_size)}
        wrapped = {}
        for fused, (part_sizes, in_features) in shapes.items():
            capacities = [ranks.get((index, fused, part), 0) + room for part in range(len(part_sizes))]
            if any(capacities):
                wrapped[fused] = LoRALinear(getattr(layer, fused), part_sizes, in_features, capacities, state)
        for fused, module in wrapped.items():
            setattr(layer, fused, module)
        state.modules.append(wrapped)
    for adapter in adapters:
        state.add(adapter)
    return state
