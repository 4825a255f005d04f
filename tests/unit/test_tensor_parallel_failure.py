"""A tensor-parallel engine fails fast, with a clear error, when a rank dies; bad sizes
are refused before any process starts."""

from __future__ import annotations

import asyncio
import os
import re
import signal

import pytest
import torch

from cluster.config import ConfigError
from cluster.hosting.backend import EngineUnhealthyError
from cluster.hosting.inproc_client import InprocClient
from cluster.hosting.protocol import GenerateRequest
from cluster.shared.sampling_params import SamplingParams
from cluster.runner.tp_executor import TensorParallelError
from cluster.parallel.layers import HeadShard, head_shard
from tests.engine_helpers import make_engine, run_to_completion

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
# A short collective timeout bounds the test if a failure were not detected at once.
TP2 = dict(tensor_parallel_size=2, num_blocks=32, block_size=8, dtype="float32", num_threads=1,
           collective_timeout_s=20)


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _kill_worker(engine) -> None:
    process = engine.worker.runner.executor.ranks[0].process
    os.kill(process.pid, signal.SIGKILL)
    process.join(10)
    assert not process.is_alive()


async def _collect(client: InprocClient, rid: str, prompt: list[int]) -> tuple[list[int], object]:
    """The tokens streamed and the error the stream ended with (None: it finished)."""
    tokens = []
    async for delta in client.generate(GenerateRequest(rid, prompt, GREEDY)):
        if delta.error is not None:
            return tokens, delta.error
        tokens += delta.token_ids
    return tokens, None


def test_killed_worker_fails_requests_and_spares_another_engine(tiny_llama_dir):
    """Two TP engines live in one process (each on its own run-time port); killing one's
    worker fails that engine's next request with a 500 at once, not a hang, and marks its
    core failed (the replica's health check then fails)."""
    first, second = make_engine(tiny_llama_dir, **TP2), make_engine(tiny_llama_dir, **TP2)
    client = InprocClient(first)
    try:
        async def scenario():
            before, error = await _collect(client, "before", [5, 6, 7, 8])
            assert error is None
            _kill_worker(first)
            after, error = await asyncio.wait_for(_collect(client, "after", [5, 6, 7, 8]), timeout=15)
            return before, after, error

        before, after, error = asyncio.run(scenario())
        assert len(before) == GREEDY.max_tokens
        assert not after and error.status == 500
        assert re.search(r"tensor-parallel rank 1 exited \(process \d+ exited with code -9\)", error.message)
        with pytest.raises(EngineUnhealthyError, match="tensor-parallel rank 1 exited"):
            client.check_health()
        assert run_to_completion(second, [[5, 6, 7, 8]], GREEDY) == [before]
    finally:
        asyncio.run(client.shutdown())
        second.worker.close()


def test_rank_dying_inside_a_step_fails_the_collective(tiny_llama_dir):
    """A rank that dies after the liveness check (mid-step) makes the collective raise;
    the engine then refuses every later step instead of running out of step."""
    engine = make_engine(tiny_llama_dir, **TP2)
    try:
        run_to_completion(engine, [[9, 10, 11]], GREEDY)
        engine.worker.runner.executor.check_alive = lambda: None  # as if the rank died after the check
        _kill_worker(engine)
        engine.add_request([9, 10, 11], GREEDY)
        with pytest.raises(TensorParallelError, match="collective failed"):
            engine.step()
        with pytest.raises(TensorParallelError, match="failed earlier"):
            engine.step()
    finally:
        engine.worker.close()


def test_sizes_that_do_not_split_are_refused_before_starting(tiny_llama_dir):
    splits = r"num_attention_heads \(4\) must be divisible by tensor_parallel_size \(3\)"
    with pytest.raises(ValueError, match=splits):
        make_engine(tiny_llama_dir, tensor_parallel_size=3, num_blocks=8)
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        make_engine(tiny_llama_dir, tensor_parallel_size=0, num_blocks=8)


def test_head_shard_splits_whole_heads_and_replicates_few_kv_heads():
    assert head_shard(32, 8, 4, rank=3) == HeadShard(8, 2, 4, 3)
    # 2 KV heads over 8 ranks: each KV head on 4 consecutive ranks.
    assert [head_shard(32, 2, 8, rank=r).kv_shard_rank for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert head_shard(32, 2, 8, rank=5) == HeadShard(4, 1, 2, 1)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        head_shard(32, 3, 4, rank=0)
    with pytest.raises(ValueError, match="must divide num_key_value_heads"):
        head_shard(24, 4, 6, rank=0)
