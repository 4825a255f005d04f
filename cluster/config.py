"""Settings of an engine, as pydantic models.

Every YAML file under ``configs/`` loads into :class:`TandemConfig`. Unknown keys and
values of the wrong type are errors that name the key (``ConfigError``).
"""

from __future__ import annotations

import argparse

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cluster.config_serve import ServeConfig
from cluster.config_k8s import KubernetesConfig


class ConfigError(ValueError):
    """A configuration file or value is invalid; the message names the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


DType = Literal["float32", "bfloat16", "float16", "auto"]
Quantization = Literal["none", "int8", "int4", "int8-dynamic", "gguf"]


class ModelConfig(_Strict):
    model: str = Field("smollm2-135m-instruct", description="short name, HF folder or .gguf file")
    dtype: DType = "float32"
    max_model_len: int | None = Field(None, ge=1, description="defaults to the model's context length")
    cache_dir: str | None = Field(None, description="where fetched and converted weights live")
    quantization: Quantization = Field(
        "none", description="int8: int8 weights, per-output-channel scales (linear layers and LM head); "
        "int4: 4-bit weights, a float16 scale and offset per 64 inputs of a row; "
        "int8-dynamic: also int8 activations per tensor (fbgemm, CPU; fast but measured far less accurate); "
        "gguf: a GGUF model's own quantized weights as the file holds them (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) "
        "for decode steps on the CPU, the same values widened for prompts and large batches")
    gguf_activations: Literal["int8+residual", "int8"] = Field(
        "int8+residual", description="quantization gguf: how decode rows meet the blocks: int8+residual (each 32 "
        "activations as int8 codes and again what those missed, about 15 bits: top-1 agreement with the widened "
        "model 100% on SmolLM2-135M) or int8 (one pass, as llama.cpp: 10-30% faster from a few rows, 97.8%)")
    batch_invariant: bool = Field(
        False, description="compute every token the same way whatever else is in the step (CPU, float32 or "
        "bfloat16): a request's output, speculative or not, no longer depends on its batch; prefill runs slower")
    seed: int = 0
    attention: Literal["auto", "gather", "flex"] = Field(
        "auto", description="how attention reads the paged KV cache: gather (copy each sequence's context out, "
        "plus the compiled CPU kernel for decode steps), flex (in place through the block table with torch's "
        "flex_attention, compiled on CUDA; on the CPU only torch's slow reference, for tests); auto: flex on "
        "CUDA with a plain KV cache, gather otherwise")
    enforce_eager: bool = Field(
        False, description="CUDA, flex attention: run decode steps eagerly instead of replaying the CUDA graph "
        "captured for their batch-size bucket at start-up (tensor-parallel ranks always run eagerly)")
    lora_modules: dict[str, str] = Field(
        default_factory=dict, description="LoRA adapters served beside the model (native engine: Llama family, one "
        "process; vLLM: what vLLM serves): name -> the folder PEFT saved it in; a request runs with one by naming it "
        "as its model (docs/lora.md)")
    max_lora_rank: int = Field(64, ge=1, description="the largest rank r of an adapter (lora_modules or lora_dir)")
    lora_dir: str | None = Field(
        None, description="a folder of adapter folders (as PEFT saves them), each served on demand under its folder's "
        "name: a request naming one that is not loaded loads it (vLLM's filesystem LoRA resolver, Ray Serve LLM's "
        "dynamic_lora_loading_path); docs/lora.md")
    max_loras: int = Field(
        8, ge=1, description="with lora_dir: the most adapters loaded at once, lora_modules included; the least "
        "recently used one that no request in the engine holds is unloaded to make room, and a request waits while "
        "every one is held")
    tool_call_format: Literal["auto", "hermes", "llama3_json", "prompt"] = Field(
        "auto", description="how tools reach the prompt and calls come back (docs/structured-outputs.md): hermes "
        "(the chat template takes tools=, calls are <tool_call> blocks: Qwen 2.5), llama3_json (the template takes "
        "tools=, a call is a JSON object with name and parameters: Llama 3.1/3.2), prompt (the template knows no "
        "tools: Tandem writes them into the system prompt, calls are <tool_call> blocks); auto picks from the "
        "chat template's text")


class CacheConfig(_Strict):
    block_size: int = Field(16, ge=1, le=1024)
    kv_cache_memory: str | int | None = Field(
        "512MiB", description="bytes, or a size like '2GiB', per rank (each tensor-parallel rank's pool; the draft's "
        "cache comes on top, on rank 0); overrides kv_cache_fraction"
    )
    kv_cache_fraction: float = Field(
        0.3, gt=0, le=0.95, description="share of the memory free on each rank's device after the target's weights, "
        "when kv_cache_memory is unset"
    )
    num_blocks: int | None = Field(None, ge=1, description="exact pool size; overrides both")
    enable_prefix_caching: bool = True
    kv_cache_dtype: Literal["auto", "int8"] = Field(
        "auto", description="auto: the model's dtype; int8: int8 K/V with a scale per token and head (~2x the tokens of bfloat16)")

    @field_validator("kv_cache_memory")
    @classmethod
    def _check_size(cls, value):
        if value is not None:
            parse_size(value)
        return value

    def memory_bytes(self) -> int | None:
        return parse_size(self.kv_cache_memory) if self.kv_cache_memory is not None else None


class SchedulerConfig(_Strict):
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    enable_chunked_prefill: bool = True
    waiting_served_ratio: float = Field(
        0.0, ge=0, description="TGI's knob: while requests run, admit waiting ones only once there are "
        "at least running * ratio of them (or one waited 20 steps); 0 admits at once, like vLLM"
    )
    max_prompt_tokens_beside_decodes: int = Field(
        0, ge=0, description="in a step that also decodes, prompts get at most this many tokens together, so a "
        "running decode waits for no more prompt than that (0: off, prompts take what the token budget leaves)"
    )
    max_queued_requests: int | None = Field(None, ge=1)
    policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="fcfs: first come, first served; priority: waiting requests by their priority "
        "(lower first, then arrival), and the lowest-priority running request is the one preempted "
        "(vLLM's scheduling_policy)"
    )


class SpeculativeConfig(_Strict):
    method: Literal["none", "draft", "ngram", "suffix", "eagle3"] = "none"
    draft_model: str | None = Field(
        None, description="method draft: short name, HF folder or .gguf file; method eagle3: an EAGLE-3 head "
        "folder (the published layout) or a shipped head's name")
    draft_dtype: DType | None = Field(None, description="defaults to the target's dtype")
    draft_quantization: Quantization | None = Field(
        None, description="the draft's model.quantization (defaults to the target's); int4 or int8 with the "
        "target itself as draft_model is self-speculation")
    num_speculative_tokens: int = Field(4, ge=0, le=16, description="k (fixed), or the largest k (table, adaptive)")
    controller: Literal["fixed", "table", "adaptive"] = "fixed"
    profile: str | None = Field(None, description="`tandem profile` JSON: needed by table; adaptive starts from it "
                                "when it exists, else from a built-in prior, and learns online either way")
    hysteresis: float = Field(0.05, ge=0, lt=1, description="adaptive: switch k (and start drafting) only when "
                              "this much better; a k predicted slower than plain decoding is left at once")
    explore_budget: float = Field(
        0.001, ge=0, le=1, description="adaptive: the most its probes (one draft token more than the k held) "
        "may add to the mean predicted step time")
    learn_past_k: bool = Field(
        True, description="adaptive, with ngram or suffix: draft up to the largest k every step, verify the k held, "
        "and score the rest against the tokens each request goes on to produce, so acceptance at every depth is "
        "learnt without verifying it")
    verification: Literal["auto", "rejection", "coupled"] = Field(
        "auto", description="how drafts are checked: rejection sampling, or coupling (the target's own draw at each "
        "position with that position's seeded number; a seeded request's text is then the same whatever k). auto: "
        "coupled for seeded requests, rejection sampling for the others")
    ngram_min: int = Field(1, ge=1)
    ngram_max: int = Field(4, ge=1)
    ngram_draft_per_match_token: float | None = Field(
        1.0, ge=0, description="a lookup match shorter than ngram_max tokens proposes at most this many draft "
        "tokens per matched token; null: every match proposes k, as vLLM's")
    # method suffix: vLLM's keys and defaults (its speculative_config), arctic-inference's trees.
    suffix_decoding_max_tree_depth: int = Field(
        24, ge=1, description="suffix: the longest context matched and the deepest the trees go")
    suffix_decoding_max_cached_requests: int = Field(
        10000, ge=0, description="suffix: finished responses kept in the replica-wide tree (oldest evicted first; "
        "0: only the request's own prompt and output)")
    suffix_decoding_max_spec_factor: float = Field(
        1.0, gt=0, description="suffix: a request drafts at most this many tokens per matched token (and at most k)")
    suffix_decoding_min_token_prob: float = Field(
        0.1, ge=0, le=1, description="suffix: drafting stops where the continuation's estimated probability (the "
        "product of branch frequencies) falls below this")
    suffix_warm_start_requests: int = Field(
        1000, ge=0, description="suffix, served by the native engine: a replica that starts beside running ones "
        "seeds its replica-wide tree with up to this many of one's latest finished responses, so a scale-up does "
        "not start cold (0: every replica starts with empty trees)")

    @model_validator(mode="after")
    def _check(self) -> "SpeculativeConfig":
        if self.method in ("draft", "eagle3") and not self.draft_model:
            raise ValueError(f"speculative.draft_model is required when speculative.method is {self.method!r}")
        if self.ngram_min > self.ngram_max:
            raise ValueError("speculative.ngram_min must be <= speculative.ngram_max")
        return self


class DeviceConfig(_Strict):
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads (on a GPU, for the host's "
                                    "step metadata: 1 when unset)")


class ParallelConfig(_Strict):
    tensor_parallel_size: int = Field(
        1, ge=1, description="ranks the target model is split over inside one engine (gloo on CPU, NCCL on CUDA)"
    )
    collective_timeout_s: float = Field(
        60.0, gt=0, description="a tensor-parallel collective waiting this long fails the step instead of hanging"
    )


class EngineConfig(_Strict):
    """Which engine serves: Tandem's own (``native``) or vLLM's (``vllm``, the ``vllm`` extra).

    The other sections configure both; vLLM reads model, cache, scheduler, speculative
    (n-gram, draft, suffix or EAGLE-3, k, and a profile's k table as ``num_speculative_tokens_per_batch_size``)
    and parallel, and ``vllm_args`` passes further keyword arguments to its ``AsyncEngineArgs``.
    """

    backend: Literal["native", "vllm"] = "native"
    core_process: bool = Field(
        True, description="native engine: step in an engine-core process of its own, handing the replica one "
                          "message per step (tensor-parallel groups step in the replica's process)")
    vllm_args: dict = Field(default_factory=dict, description="extra vLLM engine arguments, e.g. {enforce_eager: true}")


class TandemConfig(_Strict):
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    device: DeviceConfig = DeviceConfig()
    parallel: ParallelConfig = ParallelConfig()
    engine: EngineConfig = EngineConfig()
    serve: ServeConfig = ServeConfig()
    kubernetes: KubernetesConfig = KubernetesConfig()  # read only by `tandem k8s render`

    @model_validator(mode="after")
    def _check(self) -> "TandemConfig":
        if self.model.batch_invariant:
            clashes = {"model.quantization": self.model.quantization != "none",
                       "cache.kv_cache_dtype": self.cache.kv_cache_dtype != "auto",
                       "parallel.tensor_parallel_size": self.parallel.tensor_parallel_size > 1}
            for key, clash in clashes.items():
                if clash:
                    raise ValueError(f"model.batch_invariant runs the full-precision model on one device with a "
                                     f"plain KV cache; {key} must stay at its default")
        if self.model.attention == "flex":
            clashes = {"cache.kv_cache_dtype": self.cache.kv_cache_dtype != "auto",
                       "model.batch_invariant": self.model.batch_invariant}
            for key, clash in clashes.items():
                if clash:
                    raise ValueError(f"model.attention flex reads a plain KV cache in place and has no "
                                     f"batch-invariant mode; {key} must stay at its default")
        for name in self.model.lora_modules:
            if not name.strip() or name in (self.model.model, self.serve.served_model_name):
                raise ValueError(f"model.lora_modules: {name!r} cannot name an adapter (empty, or the base model's "
                                 "name: a request names an adapter as its model)")
        adapters = self.model.lora_modules or self.model.lora_dir
        if adapters and self.parallel.tensor_parallel_size > 1 and self.engine.backend == "native":
            raise ValueError("the native engine serves LoRA adapters (model.lora_modules, model.lora_dir) in one "
                             "process; parallel.tensor_parallel_size must be 1 (or the group must run vLLM)")
        if self.model.lora_dir is not None and self.model.max_loras <= len(self.model.lora_modules):
            raise ValueError(f"model.max_loras ({self.model.max_loras}) leaves no room for adapters from "
                             f"model.lora_dir beside the {len(self.model.lora_modules)} of model.lora_modules")
        limit = self.scheduler.max_num_batched_tokens
        if not self.scheduler.enable_chunked_prefill and self.model.max_model_len:
            if limit < self.model.max_model_len:
                raise ValueError(
                    "scheduler.max_num_batched_tokens must be >= model.max_model_len "
                    "when chunked prefill is off"
                )
        spec = self.speculative
        if spec.controller == "table" and spec.method != "none" and not spec.profile:
            # Each replica group may bring the profile measured on its own device.
            missing = [g.name for g in self.serve.groups if not g.profile]
            if missing:
                raise ValueError("speculative.profile is required by the 'table' controller (or a profile in every "
                                 f"serve group; missing in: {', '.join(missing)}); 'adaptive' starts without one")
        for group in self.serve.groups:
            if group.engine:
                try:
                    group_engine_config(self, group.name)
                except ConfigError as err:
                    raise ValueError(f"serve.groups[{group.name}].engine: {err}") from None
        return self


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(value: str | int) -> int:
    """'512MiB' -> 536870912; plain integers are bytes."""
    if isinstance(value, int):
        if value <= 0:
            raise ConfigError(f"a memory size must be positive, got {value}")
        return value
    text = value.strip().upper().replace(" ", "")
    number = text.rstrip("KMGIB")
    unit = text[len(number):]
    try:
        size = int(float(number) * _UNITS[unit])
    except (KeyError, ValueError):
        size = 0
    if size <= 0:
        raise ConfigError(f"cannot read memory size {value!r}; use e.g. 536870912, '512MiB' or '2GiB'")
    return size


def format_errors(err: ValidationError, source: str) -> str:
    """A pydantic validation error as lines naming each bad key, for ``ConfigError``."""
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(f"{source}: unknown key '{key}'")
        else:
            lines.append(f"{source}: '{key}': {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def config_from_dict(data: dict, source: str = "config") -> TandemConfig:
    try:
        return TandemConfig.model_validate(data or {})
    except ValidationError as err:
        raise ConfigError(format_errors(err, source)) from None


def read_yaml_mapping(path: Path, what: str = "config file") -> dict | None:
    """The YAML mapping at ``path`` (None for an empty file); ConfigError names the file otherwise."""
    if not path.is_file():
        raise ConfigError(f"{what} {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return data


def load_config(path: str | Path) -> TandemConfig:
    path = Path(path)
    config = config_from_dict(read_yaml_mapping(path), str(path))
    # A profile named in a YAML file is found next to that file.
    config.speculative.profile = path_beside(path, config.speculative.profile)
    for group in config.serve.groups:
        group.profile = path_beside(path, group.profile)
    return config


def path_beside(config_path: Path, relative: str | None) -> str | None:
    """A path in a settings file, relative to that file (absolute paths and None unchanged)."""
    if relative and not Path(relative).is_absolute():
        return str((config_path.parent / relative).resolve())
    return relative


def with_overrides(config: TandemConfig, **overrides) -> TandemConfig:
    """A copy of ``config`` with flat overrides routed to the section that owns each key.

    ``with_overrides(cfg, dtype="bfloat16", max_num_seqs=8)`` sets ``model.dtype`` and
    ``scheduler.max_num_seqs``. Unknown keys raise ConfigError naming them.
    """
    data = config.model_dump()
    sections = {name: type(getattr(config, name)) for name in TandemConfig.model_fields
                if name not in ("serve", "kubernetes")}
    for key, value in overrides.items():
        owners = [s for s, cls in sections.items() if key in cls.model_fields]
        if not owners:
            known = sorted(k for cls in sections.values() for k in cls.model_fields)
            raise ConfigError(f"unknown setting {key!r}; known settings: {', '.join(known)}")
        data[owners[0]][key] = value
    return config_from_dict(data, "overrides")


def group_engine_config(config: TandemConfig, group_name: str) -> TandemConfig:
    """The engine settings of one replica group: the shared ones, the group's ``engine``
    overrides and its profile. The result's ``serve.groups`` holds only that group."""
    groups = {g.name: g for g in config.serve.groups}
    if group_name not in groups:
        raise ConfigError(f"no replica group {group_name!r}; groups: {', '.join(groups)}")
    group = groups[group_name]
    data = config.model_dump()
    data["serve"]["groups"] = [group.model_copy(update={"engine": {}}).model_dump()]
    base = config_from_dict(data, f"serve.groups[{group_name}]")
    result = with_overrides(base, **group.engine) if group.engine else base
    if group.profile:
        result.speculative.profile = group.profile
    return result


# ---- the settings a command line gives (tandem generate, tandem profile) -----------------------
def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """--config and the flat overrides every engine command takes."""
    parser.add_argument("--config", help="YAML settings file (e.g. configs/local.yaml)")
    parser.add_argument("--model", help="short name, Hugging Face folder or .gguf file")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "auto"])
    parser.add_argument("--device", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--tensor-parallel-size", type=int,
                        help="split the target over this many ranks (processes; GPUs on CUDA)")


def engine_config_from_args(args: argparse.Namespace) -> TandemConfig:
    """The settings of ``--config`` (or the defaults) with the command line's overrides."""
    config = load_config(args.config) if args.config else TandemConfig()
    pairs = (("model", args.model), ("dtype", args.dtype), ("device", args.device),
             ("tensor_parallel_size", getattr(args, "tensor_parallel_size", None)))
    overrides = {k: v for k, v in pairs if v is not None}
    return with_overrides(config, **overrides)
