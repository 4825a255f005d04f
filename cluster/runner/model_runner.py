"""Batch -> tensors -> logits -> sampled tokens, for one model and its paged KV cache.

The runner owns everything with a tensor in it: the model, the preallocated K/V pool
and the per-request sampling generators. The scheduler's block ids index the pool.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from cluster.engine.scheduler import ScheduledRequest
from cluster.runner.input_batch import prepare_inputs
from cluster.runner.sampler import Sampler, SamplingMetadata


class SampledToken(NamedTuple):
    token_id: int
    # (token ids, logprobs, rank of the sampled token): sampled first, then the top-n
    logprobs: tuple[list[int], list[float], int] | None


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element


def free_device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def num_blocks_for_budget(spec: KVCacheSpec, budget_bytes: int) -> int:
    num_blocks = budget_bytes // spec.bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"a KV budget of {budget_bytes} bytes holds no block of {spec.bytes_per_block} bytes; "
            "raise cache.kv_cache_memory"
        )
    return int(num_blocks)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, spec: KVCacheSpec, device: torch.device) -> None:
        self.model = model
        self.spec = spec
        self.device = device
        self.num_blocks = num_blocks
        # [num_layers, 2 (K, V), num_slots, num_kv_heads, head_dim]
        self.kv_caches = torch.zeros(
            spec.num_layers, 2, num_blocks * spec.block_size, spec.num_kv_heads, spec.head_dim,
            dtype=spec.dtype, device=device,
        )
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}

    def free_request(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def _generator(self, request) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None or request.sampling_params.greedy:
            return None
        gen = self.generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seed)
            self.generators[request.request_id] = gen
        return gen

    @torch.inference_mode()
    def execute(
        self, scheduled: list[ScheduledRequest], block_tables: list[list[int]]
    ) -> dict[str, SampledToken]:
        """Run one forward pass over the step and sample for requests that reached their end."""
        if not scheduled:
            return {}
        inputs = prepare_inputs(scheduled, block_tables, self.spec.block_size, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn)
        if not inputs.sampling_rows:
            return {}
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))
        requests = [scheduled[row].request for row in inputs.sampling_rows]
        metadata = SamplingMetadata.build(
            params=[r.sampling_params for r in requests],
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=[r.output_token_ids for r in requests],
            generators=[self._generator(r) for r in requests],
            banned_token_ids=[_banned_ids(r) for r in requests],
            vocab_size=logits.shape[-1],
            device=self.device,
        )
        out = self.sampler(logits, metadata)
        token_ids = out.sampled_token_ids.tolist()
        results: dict[str, SampledToken] = {}
        lp = out.logprobs
        lp_ids = lp.token_ids.tolist() if lp is not None else None
        lp_vals = lp.logprobs.tolist() if lp is not None else None
        lp_ranks = lp.sampled_rank.tolist() if lp is not None else None
        for i, request in enumerate(requests):
            num = request.sampling_params.logprobs
            logprobs = None
            if num is not None and lp is not None:
                logprobs = (lp_ids[i][: num + 1], lp_vals[i][: num + 1], lp_ranks[i])
            results[request.request_id] = SampledToken(token_ids[i], logprobs)
        return results


def _banned_ids(request) -> list[int]:
    """EOS and stop token ids may not be sampled before ``min_tokens`` outputs."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        return []
    banned = list(params.stop_token_ids)
    if request.eos_token_id is not None:
        banned.append(request.eos_token_id)
    return banned
