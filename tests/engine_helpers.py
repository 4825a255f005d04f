"""Driving an Engine in tests: build one from overrides, run prompts to completion, close a
backend's stream early."""

from __future__ import annotations

import asyncio

from cluster.config import TandemConfig, with_overrides
from cluster.engine.engine import Engine
from cluster.shared.sampling_params import SamplingParams


def make_engine(model_path, **overrides) -> Engine:
    return Engine(with_overrides(TandemConfig(), model=str(model_path), device="cpu", **overrides))


def run_to_completion(engine: Engine, prompts, params) -> list[list[int]]:
    """Output token ids per prompt, checking invariants after every step and that every
    block is free at the end."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.pool.num_blocks
    return [done[i] for i in ids]


def drain(engine: Engine, live: set[str]) -> None:
    """Step until nothing is left, dropping finished ids from ``live``."""
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
        engine.check_invariants()


async def close_after_tokens(backend, request, num_tokens: int = 2) -> dict:
    """Read ``request``'s stream from ``backend`` until ``num_tokens`` tokens came, close it, and
    return the backend's engine stats once nothing runs there (the abort reaches an engine core
    between two of its steps), or the last stats read after about 10 s."""
    stream = backend.generate(request)
    seen = 0
    async for delta in stream:
        seen += len(delta.token_ids)
        if seen >= num_tokens:
            break
    await stream.aclose()
    for _ in range(200):
        stats = await backend.engine_stats()
        if stats["num_running"] == 0:
            break
        await asyncio.sleep(0.05)
    return stats
