"""Tandem's engine settings as vLLM's ``AsyncEngineArgs`` (no vLLM import here).

What maps:

| Tandem | vLLM |
|---|---|
| ``model.model`` (short name, HF folder, ``.gguf``) | ``model``: the Hugging Face folder our loader resolves it to (a short name or a GGUF file is converted once into the loader's cache, as for the native engine) |
| ``model.dtype``, ``max_model_len``, ``seed`` | ``dtype`` (``auto`` stays ``auto``), ``max_model_len``, ``seed`` |
| ``cache.block_size``, ``enable_prefix_caching``, ``kv_cache_memory`` | ``block_size``, ``enable_prefix_caching``, ``kv_cache_memory_bytes`` |
| ``scheduler.max_num_seqs``, ``max_num_batched_tokens``, ``enable_chunked_prefill`` | the same names |
| ``scheduler.policy`` (``fcfs``, ``priority``) | ``scheduling_policy`` (a request's ``priority`` goes to ``generate``) |
| ``scheduler.max_prompt_tokens_beside_decodes`` | nothing: vLLM caps each long prompt's chunk in every step instead (``long_prefill_token_threshold``, set in ``engine.vllm_args``) |
| ``speculative.method: ngram`` / ``draft`` / ``eagle3`` | ``speculative_config``: ``{method: ngram, prompt_lookup_min/max}`` / ``{method: draft_model, model}`` / ``{method: eagle3, model}`` (the head's folder) with ``num_speculative_tokens`` |
| ``speculative.method: suffix`` and its ``suffix_decoding_*`` keys | ``speculative_config``: ``{method: suffix}`` with the same keys (vLLM needs ``arctic-inference`` in its environment) |
| ``speculative.ngram_draft_per_match_token`` | nothing: vLLM's lookup drafts ``k`` tokens after every match, however short |
| ``speculative.controller: table`` / ``adaptive`` with a profile | the profile's batch-size -> k table as ``num_speculative_tokens_per_batch_size`` (inclusive ranges ``[start, end, k]``), when the installed vLLM has that option; otherwise a fixed k (see :class:`SpecPlan`). ``adaptive`` also names Tandem's ``scheduler_cls``, which takes the table the replica re-fits online (``vllm_k_schedule.py``) |
| a group's ``tensor_parallel_size`` | ``tensor_parallel_size`` |
| ``model.enforce_eager`` | ``enforce_eager`` |
| ``engine.vllm_args`` | passed through last (e.g. ``enforce_eager``, ``quantization``) |

Quantization: vLLM's methods (``awq``, ``gptq``, ``fp8``, ...) are named in
``engine.vllm_args.quantization`` (and its KV cache type in ``vllm_args.kv_cache_dtype``);
a quantized checkpoint carries its own config. Tandem's own int8 schemes
(``model.quantization``, ``cache.kv_cache_dtype: int8``, ``speculative.draft_quantization``)
have no vLLM counterpart and are refused with a ValueError naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.config import TandemConfig
from cluster.spec_decode.profile_data import batch_size_ranges

# vLLM's scheduler class for an adaptive controller's group (cluster/backends/vllm_scheduler.py)
FOLLOWING_SCHEDULER = "cluster.backends.vllm_scheduler.following_scheduler"


# speculative.method suffix: the keys vLLM's SpeculativeConfig takes under the same names
SUFFIX_KEYS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
               "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")


@dataclass(frozen=True)
class SpecPlan:
    """How speculation is set up in vLLM: ``policy`` as in ``SpecState`` and the note to log."""

    method: str  # "none", "ngram", "suffix", "draft" or "eagle3"
    policy: str  # "none", "fixed", "batch-size-table", "adaptive-table" or "fixed-fallback"
    num_speculative_tokens: int
    k_table: dict[int, int] = field(default_factory=dict)  # batch size -> k (the table asked for)
    note: str = ""


@dataclass(frozen=True)
class VllmSettings:
    engine_args: dict  # keyword arguments of vllm.AsyncEngineArgs
    spec: SpecPlan


def vllm_settings(config: TandemConfig, tensor_parallel_size: int, model_path: str,
                  draft_path: str | None, profile_table: dict[int, int] | None,
                  has_batch_size_schedule: bool) -> VllmSettings:
    """The engine arguments for one group. ``profile_table`` is the group's profiled
    batch size -> k (None without a profile); ``has_batch_size_schedule`` says whether the
    installed vLLM's SpeculativeConfig has ``num_speculative_tokens_per_batch_size``."""
    m, c, s = config.model, config.cache, config.scheduler
    _refuse_native_quantization(config)
    args: dict = {
        "model": model_path,
        "tokenizer": model_path,
        "dtype": m.dtype,
        "seed": m.seed,
        "block_size": c.block_size,
        "enable_prefix_caching": c.enable_prefix_caching,
        "max_num_seqs": s.max_num_seqs,
        "max_num_batched_tokens": s.max_num_batched_tokens,
        "enable_chunked_prefill": s.enable_chunked_prefill,
        "scheduling_policy": s.policy,
        "tensor_parallel_size": tensor_parallel_size,
        "disable_log_stats": False,
        # Structured outputs through llguidance, the native engine's library, so that a request's
        # grammar (sent as the same Lark text, cluster.structured.constraint.vllm_fields) behaves alike.
        "structured_outputs_config": {"backend": "guidance"},
    }
    if m.max_model_len:
        args["max_model_len"] = m.max_model_len
    if m.enforce_eager:
        args["enforce_eager"] = True
    memory = c.memory_bytes()
    if memory is not None and c.num_blocks is None:
        args["kv_cache_memory_bytes"] = memory
    elif c.num_blocks is not None:
        args["num_gpu_blocks_override"] = c.num_blocks
    if m.lora_dir is not None:  # as many loaded, and in one batch, as the native engine holds
        args.update(enable_lora=True, max_loras=m.max_loras, max_cpu_loras=m.max_loras, max_lora_rank=m.max_lora_rank)
    elif m.lora_modules:  # every adapter may be in one batch, as in the native engine
        args.update(enable_lora=True, max_loras=len(m.lora_modules), max_lora_rank=m.max_lora_rank)
    spec = _spec_plan(config, profile_table, has_batch_size_schedule)
    if spec.method != "none":
        sc = config.speculative
        spec_args: dict = {"num_speculative_tokens": spec.num_speculative_tokens}
        if spec.method == "ngram":
            spec_args.update(method="ngram", prompt_lookup_min=sc.ngram_min, prompt_lookup_max=sc.ngram_max)
        elif spec.method == "suffix":
            spec_args.update(method="suffix", **{key: getattr(sc, key) for key in SUFFIX_KEYS})
        elif spec.method == "eagle3":
            spec_args.update(method="eagle3", model=draft_path)
        else:
            spec_args.update(method="draft_model", model=draft_path)
        if spec.policy in ("batch-size-table", "adaptive-table"):
            spec_args["num_speculative_tokens_per_batch_size"] = batch_size_ranges(spec.k_table)
        if spec.policy == "adaptive-table":  # vLLM's scheduler, reading the table the replica re-fits
            args["scheduler_cls"] = FOLLOWING_SCHEDULER
        args["speculative_config"] = spec_args
    args.update(config.engine.vllm_args)
    return VllmSettings(args, spec)


def _spec_plan(config: TandemConfig, table: dict[int, int] | None, has_schedule: bool) -> SpecPlan:
    sc = config.speculative
    if sc.method == "none" or sc.num_speculative_tokens == 0:
        return SpecPlan("none", "none", 0)
    k = sc.num_speculative_tokens
    if sc.controller == "fixed" or not table:
        return SpecPlan(sc.method, "fixed", k, {})
    table = {int(b): min(int(v), k) for b, v in table.items()}
    if not any(table.values()):
        return SpecPlan(sc.method, "fixed", k, table, f"the profiled table {table} never speculates; k is fixed at {k}")
    if has_schedule and sc.controller == "adaptive":
        note = (f"vLLM chooses k per batch size from a table Tandem's adaptive controller re-fits from vLLM's "
                f"steps, starting from the profiled {table} (its scheduler reads the table again when it changes)")
        return SpecPlan(sc.method, "adaptive-table", max(table.values()), table, note)
    if has_schedule:
        note = (f"vLLM chooses k per batch size from the profiled table {table} "
                "(num_speculative_tokens_per_batch_size)")
        return SpecPlan(sc.method, "batch-size-table", max(table.values()), table, note)
    note = (f"the installed vLLM has no num_speculative_tokens_per_batch_size: k is fixed at {k} "
            f"instead of the profiled table {table}")
    return SpecPlan(sc.method, "fixed-fallback", k, table, note)


def _refuse_native_quantization(config: TandemConfig) -> None:
    own = {"model.quantization": (getattr(config.model, "quantization", "none"), "none"),
           "cache.kv_cache_dtype": (getattr(config.cache, "kv_cache_dtype", "auto"), "auto"),
           "speculative.draft_quantization": (getattr(config.speculative, "draft_quantization", None), None)}
    if getattr(config.model, "attention", "auto") != "auto":
        raise ValueError(f"model.attention={config.model.attention!r} picks a path of Tandem's own engine; vLLM "
                         "chooses its attention itself (the environment variable VLLM_ATTENTION_BACKEND)")
    if getattr(config.model, "batch_invariant", False):
        raise ValueError("model.batch_invariant is Tandem's own CPU mode, which vLLM does not run; for a vLLM group "
                         "leave it unset (vLLM has its own: the environment variable VLLM_BATCH_INVARIANT=1)")
    for key, (value, off) in own.items():
        if value not in (off, "none"):
            if value == "gguf":
                raise ValueError("model.quantization='gguf' is Tandem's own engine computing from a GGUF file's "
                                 "blocks; a vLLM group leaves it unset (vLLM loads a .gguf model itself, as it "
                                 "loads it)")
            raise ValueError(f"{key}={value!r} is Tandem's own int8 scheme, which vLLM does not run; for a vLLM "
                             "group leave it unset and name vLLM's method in engine.vllm_args (quantization: fp8, "
                             "awq, gptq, ... or kv_cache_dtype: fp8)")
