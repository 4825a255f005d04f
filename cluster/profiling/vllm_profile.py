"""``tandem profile`` against vLLM's engine: the k-per-batch-size table a group with
``engine: vllm`` installs as vLLM's ``num_speculative_tokens_per_batch_size``.

The native profiler times the target's verifying pass and the draft's pass apart on
synthetic batches. vLLM drafts and verifies inside one engine step, so this profiler times
whole steps of vLLM's own engine, on the device at hand and with the group's settings:

- for each k in 0..K it builds vLLM's engine, in a fresh process of its own, with k fixed
  (k = 0: no speculation) and its core in that process (``LLMEngine`` with
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so one ``step()`` is one engine step;
- for each batch size b it runs the calibration prompts (chat template applied) in
  batches of b greedy requests with the same output length (``ignore_eos``), so that every
  batch size sees the same prompts; one short warm-up batch first;
- a step counts when all b requests are decoding and none has finished (in it or before,
  so the batch is b throughout): its wall time and the tokens it gave. ``step(b, k)`` is
  the median of those steps, ``tokens_per_step`` their mean per request, and
  ``step / tokens_per_step`` the measured time per output token;
- acceptance per position comes from vLLM's speculation counters in the k = K engine's
  counted steps, as effective rates: a request-step with no proposal (n-gram found no
  match) counts as a rejection at position 1, since it yields one token like one.

The table is read from the measured steps as the native profile's is from its grid: the
best k per batch size of ``step(b, k) / E(k)`` under the profiled acceptance
(:meth:`SpeculationProfile.best_k`). The latency model is fitted to the whole steps
(:func:`fit_steps`) for batch sizes the grid lacks and for the router's step-time curve;
``measured_tpot`` keeps the direct measurements (each k's own tokens per step).
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from tqdm import tqdm

from cluster.backends.vllm import group_settings, import_vllm, stat_logger, use_device_threads
from cluster.backends.vllm_stats import SpecCounters
from cluster.config import TandemConfig, with_overrides
from cluster.engine.llm import apply_chat_template
from cluster.models.loader import load_tokenizer, resolve_model
from cluster.profiling.calibration import CALIBRATION_PROMPTS
from cluster.profiling.profiler import device_name
from cluster.shared.device import default_device
from cluster.spec_decode.latency_model import fit_steps
from cluster.spec_decode.profile_data import SpeculationProfile


@dataclass
class StepSample:
    """One (batch size, k) cell of the grid."""

    batch_size: int
    k: int
    step_seconds: float  # median wall time of the counted steps
    tokens_per_step: float  # tokens a request gained per counted step
    num_steps: int

    @property
    def seconds_per_token(self) -> float:
        return self.step_seconds / self.tokens_per_step


def calibration_token_ids(tokenizer) -> list[list[int]]:
    """The calibration prompts as chat requests, in token ids."""
    prompts = []
    for text in CALIBRATION_PROMPTS:
        if getattr(tokenizer, "chat_template", None):
            text = apply_chat_template(tokenizer, [{"role": "user", "content": text}])
        prompts.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return prompts


def batches_of(prompts: list[list[int]], batch_size: int) -> list[list[list[int]]]:
    """Consecutive batches of ``batch_size`` prompts, taken cyclically, that cover every
    prompt at least once: each batch size sees the same mix of prompts (and so the same
    acceptance), whether it is smaller or larger than the set."""
    count = -(-len(prompts) // batch_size)
    return [[prompts[(i * batch_size + j) % len(prompts)] for j in range(batch_size)] for i in range(count)]


def effective_acceptance(counters: SpecCounters, request_steps: int, max_k: int) -> list[float]:
    """Per position j: accepted at j / (request-steps that reached j); position 1 is reached
    by every counted request-step, position j + 1 by those whose draft j was accepted."""
    rates, reached = [], request_steps
    for j in range(max_k):
        accepted = counters.accepted_per_position[j] if j < len(counters.accepted_per_position) else 0
        rates.append(accepted / reached if reached else 0.0)
        reached = accepted
    return rates


class _Engine:
    """vLLM's synchronous engine for one k, with a stat logger that keeps each step's
    speculation counters."""

    def __init__(self, config: TandemConfig) -> None:
        _, self.SamplingParams, _, _, self.TokensPrompt, _ = import_vllm()
        # here, not at the top: vLLM is optional (the vllm extra)
        from vllm.engine.arg_utils import EngineArgs
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.llm_engine import LLMEngine

        self.delta = RequestOutputKind.DELTA
        settings, _ = group_settings(config, config.parallel.tensor_parallel_size, None)
        self.last_spec = None
        # In-process core (this is a child process of its own): one step() is one engine step.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.engine = LLMEngine.from_engine_args(EngineArgs(**settings.engine_args),
                                                 stat_loggers=[stat_logger(self._record)])

    def _record(self, scheduler_stats, iteration_stats) -> None:
        self.last_spec = getattr(scheduler_stats, "spec_decoding_stats", None)

    def run(self, prompts: list[list[int]], output_len: int, spec: SpecCounters | None) -> tuple[list[float], int, int]:
        """Runs the batch to the end: (counted step seconds, tokens gained in them, request-steps)."""
        params = self.SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, output_kind=self.delta)
        ids = [f"profile-{uuid.uuid4().hex[:8]}-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            self.engine.add_request(rid, self.TokensPrompt(prompt_token_ids=prompt), params)
        produced = dict.fromkeys(ids, 0)
        seconds, tokens, request_steps, finished = [], 0, 0, False
        while self.engine.has_unfinished_requests():
            decoding = all(produced.values()) and not finished
            self.last_spec = None
            started = time.perf_counter()
            outputs = self.engine.step()
            elapsed = time.perf_counter() - started
            gained = 0
            for out in outputs:
                n = len(out.outputs[0].token_ids)
                produced[out.request_id] += n
                gained += n
            finished = finished or any(out.finished for out in outputs)
            if decoding and not finished:
                seconds.append(elapsed)
                tokens += gained
                request_steps += len(prompts)
                if spec is not None and self.last_spec is not None:
                    spec.add_step(self.last_spec)
        return seconds, tokens, request_steps

    def close(self) -> None:
        self.engine.engine_core.shutdown()
        del self.engine


def _measure_k(config: TandemConfig, k: int, batch_sizes: list[int], output_len: int, repeats: int,
               count_acceptance: bool) -> tuple[list[StepSample], SpecCounters, int]:
    """In a child process: vLLM's engine at a fixed k over every batch size."""
    use_device_threads(config)
    tokenizer = load_tokenizer(resolve_model(config.model.model, config.model.cache_dir))
    engine = _Engine(with_overrides(config, controller="fixed", num_speculative_tokens=k))
    spec, request_steps, samples = SpecCounters(), 0, []
    try:
        prompts = calibration_token_ids(tokenizer)
        engine.run(batches_of(prompts, max(batch_sizes))[0], 8, None)  # warm-up
        for b in batch_sizes:
            seconds, tokens, steps = [], 0, 0
            for batch in batches_of(prompts, b) * repeats:
                s, t, n = engine.run(batch, output_len, spec if count_acceptance else None)
                seconds, tokens, steps = seconds + s, tokens + t, steps + n
            if not seconds:
                raise ValueError(f"vLLM never decoded all {b} requests at once (k={k}): the KV cache or "
                                 "max_num_seqs is too small for this batch; lower --max-batch or raise "
                                 "cache.kv_cache_memory")
            samples.append(StepSample(b, k, statistics.median(seconds), tokens / steps, len(seconds)))
            request_steps += steps
    finally:
        engine.close()
    return samples, spec, request_steps


def run_vllm_profile(config: TandemConfig, batch_sizes: list[int], max_k: int, output_len: int = 48,
                     repeats: int = 1) -> tuple[SpeculationProfile, list[StepSample]]:
    """Measures vLLM's steps on this device for every (b, k) and returns the profile and the grid."""
    if config.speculative.method == "none":
        raise ValueError("profiling needs speculation on: set speculative.method to 'draft' or 'ngram'")
    if output_len < 8:
        raise ValueError(f"output_len={output_len}: at least 8 tokens are needed to count decoding steps")
    use_device_threads(config)  # the children inherit OMP_NUM_THREADS
    samples: list[StepSample] = []
    spec, request_steps = SpecCounters(), 0
    # One fresh process per k: vLLM keeps process-wide state (kernel overrides) that a third
    # engine built in the same process trips over, and each engine's memory goes with it.
    spawn = multiprocessing.get_context("spawn")
    with tqdm(total=max_k + 1, desc="profiling vLLM (one engine per k)") as bar:
        for k in range(max_k + 1):
            with ProcessPoolExecutor(1, mp_context=spawn) as pool:
                cells, counters, steps = pool.submit(_measure_k, config, k, batch_sizes, output_len, repeats,
                                                     k == max_k).result()
            samples += cells
            if k == max_k:
                spec, request_steps = counters, steps
            bar.update(1)
    acceptance = effective_acceptance(spec, request_steps, max_k)
    model = fit_steps([(s.batch_size, s.k, s.step_seconds) for s in samples])
    errors = [abs(model.step_time(s.batch_size, s.k) - s.step_seconds) / s.step_seconds for s in samples]
    sc = config.speculative
    profile = SpeculationProfile(
        engine="vllm",
        device=f"{device_name(default_device(config.device.device))}, vLLM",
        target_model=config.model.model,
        draft=sc.draft_model if sc.method in ("draft", "eagle3") else sc.method,
        dtype=config.model.dtype,
        tensor_parallel_size=config.parallel.tensor_parallel_size,
        max_k=max_k,
        batch_sizes=batch_sizes,
        target_grid=[(s.batch_size, s.k + 1, s.step_seconds) for s in samples],
        draft_grid=[],
        acceptance=acceptance,
        target_coef=model.target_coef,
        draft_coef=model.draft_coef,
        table={},
        fit_error=sum(errors) / len(errors),
        measured_tpot=[(s.batch_size, s.k, s.seconds_per_token) for s in samples],
    )
    return profile.model_copy(update={"table": {b: profile.best_k(b) for b in batch_sizes}}), samples


def print_grid(profile: SpeculationProfile, samples: list[StepSample]) -> None:
    """The measured grid beside the fitted model's time per output token, and the best k measured
    (each k's own tokens per step; the table, printed by the caller, reads the steps under the
    profiled acceptance)."""
    model = profile.latency_model
    print(f"{'b':>3} {'k':>2} {'step ms':>8} {'tok/step':>8} {'TPOT ms':>8} {'model ms':>8}")
    for s in samples:
        predicted = model.time_per_token(s.batch_size, s.k, profile.acceptance)
        print(f"{s.batch_size:>3} {s.k:>2} {s.step_seconds * 1e3:>8.1f} {s.tokens_per_step:>8.2f} "
              f"{s.seconds_per_token * 1e3:>8.1f} {predicted * 1e3:>8.1f}")
    measured = {}
    for s in samples:
        best = measured.get(s.batch_size)
        if best is None or s.seconds_per_token < best.seconds_per_token:
            measured[s.batch_size] = s
    print("best k measured: " + ", ".join(f"{b}: {s.k}" for b, s in measured.items()))
