"""What a host reads off Tandem's engine for the router, the metrics and the debug routes.

The engine core (``core.py``) reads them and sends them to the replica with its step outputs.
"""

from __future__ import annotations

from cluster.config import TandemConfig
from cluster.hosting.backend import SpecState
from cluster.engine.engine import Engine
from cluster.hosting.protocol import GenerateDelta
from cluster.routing.policy import peak_tokens_per_second
from cluster.routing.stats import EngineLoad
from cluster.routing.step_times import StepTimeTracker
from cluster.shared.outputs import RequestOutput
from cluster.spec_decode.latency_model import power_of_two_sizes


def output_delta(out: RequestOutput) -> GenerateDelta:
    """One step's output of one request as the delta a replica streams."""
    completion = out.outputs[0]
    return GenerateDelta(
        text=completion.delta_text,
        token_ids=list(completion.delta_token_ids),
        logprobs=completion.delta_logprobs,
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
        num_prompt_tokens=out.usage.prompt_tokens,
        num_output_tokens=out.usage.completion_tokens,
        num_cached_tokens=out.usage.cached_tokens,
        prompt_logprobs=out.prompt_logprobs,
        spec_decode=out.spec_decode if completion.finished else None,  # the request's whole, once
    )


class EngineView:
    """Readings of one engine: load, capacity, speculation in force, counters."""

    def __init__(self, engine: Engine, step_times: StepTimeTracker, config: TandemConfig) -> None:
        self.engine = engine
        self.step_times = step_times
        self.config = config

    def load(self, prefix_depth: int) -> EngineLoad:
        engine = self.engine
        spec = engine.spec_stats
        k = spec.current_k
        max_num_seqs = self.config.scheduler.max_num_seqs
        times = self.step_times
        return EngineLoad(
            num_running=engine.scheduler.num_running,
            num_waiting=engine.num_waiting,
            max_num_seqs=max_num_seqs,
            kv_cache_usage=engine.block_manager.usage,
            current_k=k,
            acceptance=spec.effective_acceptance_rate,
            step_time_curve=times.curve(k, max_num_seqs),
            prefill_seconds_per_token=times.prefill_seconds_per_token,
            speed_factor=times.speed_factor,
            cached_prefix_hashes=engine.block_manager.cached_prefix_hashes(prefix_depth),
            block_size=engine.block_manager.block_size,
            lora_adapters=frozenset(engine.adapters.loaded),
            lora_load_seconds=engine.adapters.mean_load_seconds,
        )

    def capacity_tokens_per_second(self) -> float:
        """Predicted peak output tokens/s at the current k and acceptance (0 before any
        profile or measured step)."""
        spec = self.engine.spec_stats
        k = spec.current_k
        curve = self.step_times.curve(k, self.config.scheduler.max_num_seqs)
        return peak_tokens_per_second(curve, spec.effective_acceptance_rate, k)

    def spec_state(self) -> SpecState:
        engine = self.engine
        controller = engine.controller
        if controller is None:
            return SpecState("none", "none", 0, {}, 0.0)
        spec_config = self.config.speculative
        sizes = power_of_two_sizes(self.config.scheduler.max_num_seqs)
        return SpecState(spec_config.method, spec_config.controller, engine.spec_stats.current_k,
                         controller.k_table(sizes), engine.spec_stats.acceptance_rate)

    def engine_stats(self, backend_name: str) -> dict:
        """The engine's counters and free blocks, after checking its invariants."""
        engine = self.engine
        engine.check_invariants()
        stats = engine.stats()
        pool = engine.block_manager.pool
        return {
            "backend": backend_name,
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "kv_cache_usage": stats.kv_cache_usage,
            "num_blocks": pool.num_blocks,
            "num_free_blocks": pool.num_free_blocks,
            "num_preemptions": stats.num_preemptions,
            "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
            "lora_adapters": {"loaded": engine.adapters.loaded, "loads": engine.adapters.num_loads,
                              "unloads": engine.adapters.num_unloads},
            # an adaptive controller's beliefs (computed here, on request, not in every snapshot)
            "controller": (engine.controller.estimates(power_of_two_sizes(self.config.scheduler.max_num_seqs))
                           if engine.controller is not None else None),
        }
