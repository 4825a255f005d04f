"""Memory planning: what each rank of each replica group holds, against its device's memory.

Per group and per rank, for the native engine: the target's weights (split over tensor-parallel
ranks), the draft's (whole, on rank 0, where the draft runs), the target's KV pool
(``cache.kv_cache_memory`` is a budget **per rank**; ``cache.num_blocks`` is exact; else
``kv_cache_fraction`` of what is free on the device after the target's weights and adapters), the draft's KV
pool (as many blocks as the target's, rank 0), an activation workspace for
``max_num_batched_tokens``, and what a GPU reserves before the engine allocates
(``device_kinds.GPU_RESERVED_BYTES``), and the LoRA adapters of ``model.lora_modules``
(:mod:`cluster.planning.lora_memory`). On the CPU the native engine's linear layers hold
packed copies of their weights beside them (:func:`_cpu_packed_bytes`), counted with the
weights. A vLLM group (``engine.backend: vllm``) differs as
:mod:`cluster.planning.vllm_memory` says: its weight quantization is vLLM's, the draft is split
over the ranks, and the KV budget is one pool for the target's and the draft's layers. A group
whose busiest rank needs more than one device of its kind offers is refused with the numbers and
the largest KV budget that would fit.

The activation figure is an estimate, not a measurement: one step's hidden states and MLP
intermediates for the batched tokens, one layer's K/V gathered for attention, and float32
logits (with the sampler's two working copies) for every verified position. vLLM profiles
its own at start-up; the native engine allocates as it goes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cluster.config import ConfigError, TandemConfig, group_engine_config
from cluster.kernels.build import cpu_has_vectors, kernels_enabled
from cluster.kernels.packed_linear import float32_compute_rows, onednn_packs, pair_compute_rows
from cluster.planning import vllm_memory
from cluster.planning.device_kinds import device_memory_bytes, known_kinds
from cluster.planning.lora_memory import lora_bytes
from cluster.planning.model_shapes import ModelShape, model_shape
from cluster.quant.kv_int8 import bytes_per_vector

_GIB = 1 << 30
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class RankPlan:
    rank: int
    target_weights: int
    draft_weights: int
    kv_cache: int  # the target's pool on this rank
    draft_kv_cache: int
    activations: int
    reserved: int
    lora: int = 0  # LoRA adapters' weights on this rank

    @property
    def total(self) -> int:
        return (self.target_weights + self.draft_weights + self.kv_cache + self.draft_kv_cache + self.activations
                + self.reserved + self.lora)


@dataclass
class GroupPlan:
    group: str
    device_kind: str
    device_bytes: int | None  # one device of the kind; None when the kind is unknown
    tensor_parallel_size: int
    backend: str
    dtype: str
    quantization: str
    kv_tokens: int = 0  # tokens the target's pool holds per replica (blocks x block size)
    ranks: list[RankPlan] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problem: str | None = None  # why it cannot fit; None when it fits (or cannot be checked)


def plan_memory(config: TandemConfig) -> list[GroupPlan]:
    """One plan per serve group (the config's own engine settings when it has no groups)."""
    return [_plan_group(group_engine_config(config, g.name), g.name) for g in config.serve.groups]


def check_memory(config: TandemConfig) -> list[GroupPlan]:
    """``plan_memory``, raising ConfigError when a group cannot fit its device."""
    plans = plan_memory(config)
    problems = [p.problem for p in plans if p.problem]
    if problems:
        raise ConfigError("memory: " + "\n".join(problems) + "\n(`tandem config check CONFIG` prints the plan)")
    return plans


def _dtype_bytes(name: str, device_kind: str) -> tuple[str, int]:
    if name != "auto":
        return name, _DTYPE_BYTES[name]
    if device_kind.lower() != "cpu":
        return "bfloat16", 2
    # does oneDNN compute bfloat16 on this CPU?
    return ("bfloat16", 2) if onednn_packs(torch.bfloat16) else ("float32", 4)


# Bytes a weight of each quantization: int8 (plus a float32 scale a row, negligible); int4 half a
# byte plus a float16 scale and offset per 64 inputs.
_QUANTIZED_BYTES = {"int8": 1.0, "int8-dynamic": 1.0, "int4": 0.5 + 4 / 64}
_GGUF_BLOCK_BYTES = 34 / 32  # gguf: the largest served block format (Q8_0) a weight, an upper bound


def _weight_bytes(shape: ModelShape, dtype_bytes: int, quantization: str, tp: int) -> int:
    """One rank's share: linear layers and the vocabulary are split over ``tp`` ranks. ``gguf`` keeps the
    widened weights and, beside them, the file's blocks of every linear layer and the LM head."""
    if quantization == "gguf":
        blocks = shape.linear_params + (shape.embedding_params if shape.tie_word_embeddings else 0)
        return _weight_bytes(shape, dtype_bytes, "none", tp) + int(blocks * _GGUF_BLOCK_BYTES) // tp
    per_param = _QUANTIZED_BYTES.get(quantization, dtype_bytes)
    linear = int(shape.linear_params * per_param)
    if quantization != "none" and shape.tie_word_embeddings:
        linear += int(shape.embedding_params * per_param)  # the quantized LM head is its own copy of the table
    rest = shape.embedding_params * dtype_bytes
    norms = (2 * shape.num_layers + 1) * shape.hidden_size * dtype_bytes
    return (linear + rest) // tp + norms


def _cpu_packed_bytes(shape: ModelShape, dtype: str, quantization: str, batch_invariant: bool, tp: int) -> int:
    """What the CPU's ``PackedLinear`` layers hold beyond the weights ``_weight_bytes`` counts,
    per rank: full-precision linear layers and the LM head are packed for small_gemm and for
    oneDNN or, where the pair product wins, pair_gemm (pair_gemm's alone where it takes every row;
    the plain weight freed, a tied head's embedding kept), small_gemm's alone when
    batch-invariant; a bfloat16 layer also gets widening_gemm's copy where this CPU computes
    GEMMs of several rows faster in float32 (``float32_compute_rows``). A tensor-parallel rank keeps
    its shards' plain weights beside their packs and does not pack the LM head."""
    torch_dtype = getattr(torch, dtype)
    if quantization not in ("none", "gguf") or not onednn_packs(torch_dtype):
        return 0
    element = _DTYPE_BYTES[dtype]
    if batch_invariant:
        packs = 1  # small_gemm's copy alone
    elif kernels_enabled() and cpu_has_vectors():  # where small_gemm may build (planning never builds it)
        packs = 2  # small_gemm's copy and oneDNN's (or pair_gemm's)
        if pair_compute_rows(torch.device("cpu"), torch_dtype, batch_invariant) == 1:
            packs = 1  # pair_gemm's alone, taking every row
    else:
        packs = 2 if dtype == "float32" else 1  # oneDNN's, and a float32 layer's plain weight for 1 row
    if float32_compute_rows(torch.device("cpu"), torch_dtype, batch_invariant) is not None:
        packs += 1  # widening_gemm's, in bfloat16
    if tp > 1:
        decoder = shape.linear_params - (0 if shape.tie_word_embeddings else shape.embedding_params)
        return decoder * packs * element // tp
    tied_head = shape.embedding_params if shape.tie_word_embeddings else 0
    return (shape.linear_params * (packs - 1) + tied_head * packs) * element


def _kv_bytes_per_token(shape: ModelShape, dtype_bytes: int, kv_cache_dtype: str, tp: int) -> int:
    heads = max(1, shape.num_kv_heads // tp)
    vector = bytes_per_vector(shape.head_dim) if kv_cache_dtype == "int8" else shape.head_dim * dtype_bytes
    return 2 * shape.num_layers * heads * vector


def _host_memory(config: TandemConfig, group: str) -> int | None:
    pods = config.kubernetes.groups.get(group)
    if pods is None or "memory" not in pods.model_fields_set:
        return None
    text = pods.memory
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def _plan_group(config: TandemConfig, name: str) -> GroupPlan:
    group = config.serve.groups[0]
    tp = group.tensor_parallel_size
    vllm = config.engine.backend == "vllm"
    # On device: cpu the group's device_kind is only a label (tests and demos emulate GPU kinds).
    kind = "cpu" if config.device.device == "cpu" else group.device_kind
    dtype, dtype_bytes = _dtype_bytes(config.model.dtype, kind)
    device_bytes, reserved = device_memory_bytes(kind, _host_memory(config, name))
    quantization = vllm_memory.weight_quantization(config) if vllm else config.model.quantization
    plan = GroupPlan(name, kind, device_bytes, tp, config.engine.backend, dtype, quantization)
    if device_bytes is None:
        plan.notes.append(f"device kind {kind!r} has no entry in the memory table "
                          f"({', '.join(known_kinds())}): not checked")
    target = model_shape(config.model.model)
    if target is None:
        plan.notes.append(f"no config.json at {config.model.model} and not a known model: not checked")
        return plan
    spec = config.speculative
    draft = None
    if spec.method == "draft" and spec.draft_model:
        draft = model_shape(spec.draft_model)
        if draft is None:
            plan.notes.append(f"the draft {spec.draft_model}: no config.json and not a known model; counted as 0")
    if vllm:  # see vllm_memory: the draft in the target's dtype, split over the ranks; one shared KV pool
        plan.notes.extend(vllm_memory.notes(config, draft is not None, dtype))
        target_weights = vllm_memory.weight_bytes(target, dtype_bytes, quantization, tp)
        draft_weights = vllm_memory.weight_bytes(draft, dtype_bytes, "none", tp) if draft else 0
        kv_bytes = vllm_memory.kv_element_bytes(config, dtype_bytes)
        target_token = _kv_bytes_per_token(target, kv_bytes, "auto", tp)
        draft_token = _kv_bytes_per_token(draft, kv_bytes, "auto", tp) if draft else 0
    else:  # the draft whole on rank 0, in its own dtype and quantization, with a pool of its own
        draft_dtype_bytes = _DTYPE_BYTES.get(spec.draft_dtype or dtype, dtype_bytes)
        target_weights = _weight_bytes(target, dtype_bytes, config.model.quantization, tp)
        draft_quant = spec.draft_quantization or config.model.quantization
        draft_weights = _weight_bytes(draft, draft_dtype_bytes, draft_quant, 1) if draft else 0
        if kind == "cpu":
            invariant = config.model.batch_invariant
            packed = _cpu_packed_bytes(target, dtype, config.model.quantization, invariant, tp)
            draft_dtype = spec.draft_dtype if spec.draft_dtype in _DTYPE_BYTES else dtype
            draft_packed = _cpu_packed_bytes(draft, draft_dtype, draft_quant, invariant, 1) if draft else 0
            target_weights, draft_weights = target_weights + packed, draft_weights + draft_packed
            if packed or draft_packed:
                plan.notes.append(f"weights include the CPU's packed copies of the linear layers: "
                                  f"{_gib(packed)} (target), {_gib(draft_packed)} (draft)")
        target_token = _kv_bytes_per_token(target, dtype_bytes, config.cache.kv_cache_dtype, tp)
        draft_token = _kv_bytes_per_token(draft, draft_dtype_bytes, config.cache.kv_cache_dtype, 1) if draft else 0
    block_size = config.cache.block_size
    target_block, draft_block = block_size * target_token, block_size * draft_token
    budget_block = target_block + draft_block if vllm else target_block  # what cache.kv_cache_memory pays for
    k = spec.num_speculative_tokens if spec.method != "none" else 0
    activations = _activation_bytes(config, target, dtype_bytes, tp, k)
    adapters, lora_note = lora_bytes(config, target, dtype_bytes, tp, vllm)
    if lora_note:
        plan.notes.append(f"{lora_note}: {_gib(adapters)} per rank")

    cache = config.cache
    if cache.num_blocks is not None:
        num_blocks = cache.num_blocks
    elif cache.memory_bytes() is not None:
        num_blocks = cache.memory_bytes() // budget_block
    elif device_bytes is not None and vllm:
        utilization = vllm_memory.gpu_memory_utilization(config)
        free = int(device_bytes * utilization) - reserved - target_weights - draft_weights - activations - adapters
        num_blocks = max(0, free) // budget_block
        plan.notes.append(f"gpu_memory_utilization {utilization} of one {kind}, less weights, activations and "
                          f"CUDA's share: {_gib(num_blocks * budget_block)} of KV cache per rank")
    elif device_bytes is not None:
        free = device_bytes - reserved - target_weights - adapters
        num_blocks = max(0, int(free * cache.kv_cache_fraction)) // target_block
        after = "target's weights and LoRA adapters" if adapters else "target's weights"
        plan.notes.append(f"kv_cache_fraction {cache.kv_cache_fraction} of the {_gib(free)} free after the "
                          f"{after} on one {kind}: {_gib(num_blocks * target_block)} per rank")
    else:
        plan.notes.append("KV cache: a share of free memory on an unknown device: not counted")
        num_blocks = 0
    plan.kv_tokens = num_blocks * block_size
    for rank in range(tp):
        has_draft = vllm or rank == 0  # vLLM splits the draft like the target; the native engine runs it on rank 0
        plan.ranks.append(RankPlan(rank, target_weights, draft_weights if has_draft else 0, num_blocks * target_block,
                                   num_blocks * draft_block if has_draft else 0, activations, reserved, adapters))
    if device_bytes is not None:
        busiest = max(plan.ranks, key=lambda r: r.total)
        if busiest.total > device_bytes:
            plan.problem = _refusal(plan, busiest, target_block + draft_block, device_bytes)
    return plan


def _activation_bytes(config: TandemConfig, shape: ModelShape, dtype_bytes: int, tp: int, k: int) -> int:
    tokens = config.scheduler.max_num_batched_tokens + config.scheduler.max_num_seqs * k
    per_token = (4 * shape.hidden_size + (2 * shape.intermediate_size
                 + (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim) // tp) * dtype_bytes
    context = min(config.scheduler.max_num_seqs * (config.model.max_model_len or 4096), 1 << 20)
    gathered = 2 * context * max(1, shape.num_kv_heads // tp) * shape.head_dim * dtype_bytes
    logits = 3 * config.scheduler.max_num_seqs * (k + 1) * shape.vocab_size * 4 // tp
    return tokens * per_token + gathered + logits


def _refusal(plan: GroupPlan, rank: RankPlan, bytes_per_block: int, device_bytes: int) -> str:
    others = rank.total - rank.kv_cache - rank.draft_kv_cache
    room = device_bytes - others
    vllm = plan.backend == "vllm"
    # The native engine's budget pays for the target's pool, the draft's comes on top; vLLM's pays for both.
    budget = room if vllm else room * rank.kv_cache // max(1, rank.kv_cache + rank.draft_kv_cache)
    quantize = "engine.vllm_args.quantization: fp8" if vllm else "model.quantization: int8"
    fix = (f"set engine.kv_cache_memory (a budget per rank) to at most {_gib(budget)}"
           if room > bytes_per_block else
           f"the weights alone do not fit: raise tensor_parallel_size, quantize ({quantize}) "
           "or choose a smaller draft")
    return (f"serve.groups[{plan.group}] does not fit one {plan.device_kind} ({_gib(device_bytes)}): rank "
            f"{rank.rank} needs {_gib(rank.total)} = target weights {_gib(rank.target_weights)} + draft weights "
            f"{_gib(rank.draft_weights)} + KV cache {_gib(rank.kv_cache)} + draft KV cache {_gib(rank.draft_kv_cache)}"
            f" + activations {_gib(rank.activations)} + reserved {_gib(rank.reserved)}"
            f"{f' + LoRA adapters {_gib(rank.lora)}' if rank.lora else ''}; {fix}")


def _gib(value: int) -> str:
    return f"{value / _GIB:.2f} GiB"


def format_plans(plans: list[GroupPlan]) -> str:
    """The plan as a text table, one row per rank, then each group's notes and verdict."""
    header = (f"{'group':<10} {'rank':>4} {'target':>10} {'draft':>10} {'KV cache':>10} {'draft KV':>10} "
              f"{'activ.':>10} {'reserved':>10} {'LoRA':>10} {'total':>10} {'device':>10}")
    lines = [header, "-" * len(header)]
    for plan in plans:
        for r in plan.ranks:
            device = _gib(plan.device_bytes) if plan.device_bytes else "?"
            lines.append(f"{plan.group:<10} {r.rank:>4} {_gib(r.target_weights):>10} {_gib(r.draft_weights):>10} "
                         f"{_gib(r.kv_cache):>10} {_gib(r.draft_kv_cache):>10} {_gib(r.activations):>10} "
                         f"{_gib(r.reserved):>10} {_gib(r.lora):>10} {_gib(r.total):>10} {device:>10}")
        lines.append(f"  {plan.group}: {plan.device_kind}, tensor parallel {plan.tensor_parallel_size}, "
                     f"{plan.backend} engine, {plan.dtype}, quantization {plan.quantization}; "
                     f"KV cache holds {plan.kv_tokens:,} tokens per replica")
        lines.extend(f"  note: {note}" for note in plan.notes)
        lines.append(f"  REFUSED: {plan.problem}" if plan.problem else
                     "  fits" if plan.ranks and plan.device_bytes else "  not checked")
    return "\n".join(lines)
