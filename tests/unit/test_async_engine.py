"""AsyncEngine: streaming, concurrency, and aborts when the consumer goes away."""

from __future__ import annotations

import asyncio

import pytest

from cluster.config import TandemConfig, with_overrides
from cluster.engine.async_engine import AsyncEngine
from cluster.engine.llm import LLM
from cluster.engine.protocol import QueueFullError
from cluster.shared.sampling_params import SamplingParams

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture()
def engine(tiny_llama_dir) -> AsyncEngine:
    return AsyncEngine.from_config(
        with_overrides(TandemConfig(), model=str(tiny_llama_dir), device="cpu", num_blocks=64)
    )


def test_stream_matches_offline_generation(engine, tiny_llama_dir):
    params = SamplingParams(max_tokens=16, **GREEDY)
    expected = LLM(str(tiny_llama_dir), device="cpu", num_blocks=64).generate(["Hello"], params)[0]

    async def run():
        chunks = [out async for out in engine.generate("Hello", params)]
        await engine.shutdown()
        return chunks

    chunks = asyncio.run(run())
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert [t for c in chunks for t in c.outputs[0].delta_token_ids] == expected.outputs[0].token_ids
    assert "".join(c.outputs[0].delta_text for c in chunks) == expected.outputs[0].text
    assert chunks[-1].usage.completion_tokens == 16


def test_concurrent_requests_all_finish(engine):
    async def one(i):
        params = SamplingParams(max_tokens=4 + i, **GREEDY)
        last = None
        async for out in engine.generate(f"prompt {i}", params):
            last = out
        return len(last.outputs[0].token_ids)

    async def run():
        lengths = await asyncio.gather(*(one(i) for i in range(8)))
        await engine.shutdown()
        return lengths

    assert asyncio.run(run()) == [4 + i for i in range(8)]
    engine.engine.check_invariants()


def test_consumer_that_stops_early_aborts_and_frees_blocks(engine):
    pool = engine.engine.block_manager.pool

    async def run():
        stream = engine.generate("a long story", SamplingParams(max_tokens=100, **GREEDY))
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await stream.aclose()
        other = [o async for o in engine.generate("short", SamplingParams(max_tokens=3, **GREEDY))]
        await engine.shutdown()
        return other

    other = asyncio.run(run())
    assert other[-1].finished
    assert not engine.engine.has_unfinished()
    assert pool.num_free_blocks == pool.num_blocks
    engine.engine.check_invariants()


def test_cancelled_task_aborts_its_request(engine):
    streaming = asyncio.Event()

    async def consume():
        async for _ in engine.generate("cancel me", SamplingParams(max_tokens=500, **GREEDY)):
            streaming.set()

    async def run():
        task = asyncio.create_task(consume())
        await streaming.wait()  # cancelled mid-stream (a fixed sleep let a fast machine finish first)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        done = [o async for o in engine.generate("next", SamplingParams(max_tokens=2, **GREEDY))]
        await engine.shutdown()
        return done

    assert asyncio.run(run())[-1].finished
    assert not engine.engine.has_unfinished()


def test_bad_input_raises_before_streaming(engine):
    async def run():
        with pytest.raises(ValueError, match="empty"):
            async for _ in engine.generate("", SamplingParams()):
                pass
        with pytest.raises(ValueError, match="lone surrogate"):  # the tokenizer's own error is a TypeError
            async for _ in engine.generate("a\udcff", SamplingParams()):
                pass
        ok = [o async for o in engine.generate("fine", SamplingParams(max_tokens=2, **GREEDY))]
        await engine.shutdown()
        return ok

    assert asyncio.run(run())[-1].finished


def test_full_queue_rejects_then_frees_blocks_and_accepts_again(tiny_llama_dir):
    # One sequence runs at a time, so every other request waits; two may wait.
    engine = AsyncEngine.from_config(with_overrides(
        TandemConfig(), model=str(tiny_llama_dir), device="cpu", num_blocks=64, max_num_seqs=1,
        max_queued_requests=2))
    pool = engine.engine.block_manager.pool
    long = SamplingParams(max_tokens=100, **GREEDY)

    async def consume(stream):
        return [out async for out in stream]

    async def run():
        running = engine.generate("runs first", long, request_id="a")
        first = await running.__anext__()  # "a" holds the only running slot
        rest = asyncio.create_task(consume(running))
        waiting = {rid: asyncio.create_task(consume(engine.generate(f"waits {rid}", long, request_id=rid)))
                   for rid in ("b", "c")}
        await asyncio.sleep(0)  # both are queued (pending or waiting in the scheduler)
        assert engine.num_waiting == 2
        with pytest.raises(QueueFullError, match="max_queued_requests=2"):
            await engine.generate("one too many", long, request_id="d").__anext__()
        assert "d" not in engine.engine.scheduler.requests
        waiting["b"].cancel()  # aborts "b"
        with pytest.raises(asyncio.CancelledError):
            await waiting["b"]
        outputs = [[first] + await rest, await waiting["c"]]
        assert not engine.engine.has_unfinished()
        free_after_queue = pool.num_free_blocks
        # The rejected id was never taken, and the queue has room again.
        again = [o async for o in engine.generate("accepted", SamplingParams(max_tokens=3, **GREEDY),
                                                  request_id="d")]
        await engine.shutdown()
        return outputs, free_after_queue, again

    (a, c), free_after_queue, again = asyncio.run(run())
    assert len(a[-1].outputs[0].token_ids) == 100 and a[-1].finished
    assert len(c[-1].outputs[0].token_ids) == 100 and c[-1].finished
    assert free_after_queue == pool.num_blocks
    assert again[-1].finished and len(again[-1].outputs[0].token_ids) == 3
    assert pool.num_free_blocks == pool.num_blocks
    engine.engine.check_invariants()
