"""Multi-turn replay: conversations whose turns wait for each other, as a chat user's or an agent's do.

A conversation is a list of requests, each the whole history up to the assistant's next turn
(so each prompt extends the one before it). A conversation sends its next turn once the answer
to the last one has streamed in full (plus ``think_s``). Two ways to start conversations: a
closed loop, ``concurrency`` at once, a finished conversation's place going to the next one
waiting; or an open one, conversations arriving at ``conversation_rate`` per second (Poisson,
seeded) however many are still running, as new users arrive at a service. Each request is
sent and timed by :func:`~cluster.bench.serve_client.send_request`; the records keep the turn
they came from, so first turns (no replica holds any of their history) and later turns (one
replica served the history before) are summarized apart (:func:`summarize_turns`).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass

from cluster.bench.serve import ENDPOINTS, ServeBenchOptions, request_body
from cluster.bench.serve_client import first_model_id, send_request
from cluster.bench.serve_metrics import DEFAULT_PERCENTILES, RequestRecord, summarize
from cluster.bench.serve_workload import BenchRequest, arrival_times


@dataclass(frozen=True)
class TurnRecord:
    conversation: int
    turn: int  # 0 for a conversation's first request
    record: RequestRecord


@dataclass(frozen=True)
class ConversationReplay:
    model: str
    duration_s: float
    turns: list[TurnRecord]


async def replay_conversations(url: str, conversations: list[list[BenchRequest]], concurrency: int, *,
                               conversation_rate: float | None = None, seed: int = 0, temperature: float = 0.0,
                               ignore_eos: bool = True, think_s: float = 0.0, warmups: list[BenchRequest] = (),
                               timeout_s: float = 3600.0) -> ConversationReplay:
    """Play ``conversations`` against ``url`` (``/v1/completions``), each turn after the previous
    answer: ``concurrency`` at a time, or arriving at ``conversation_rate`` per second when it is
    given. ``warmups`` go first, one by one, untimed. Raises ValueError for an empty conversation,
    concurrency < 1 or a rate that is not positive, RuntimeError if a warm-up fails."""
    import aiohttp  # here, not at the top: would add ~0.08 s to every tandem command, for this benchmark only

    if concurrency < 1 or any(not turns for turns in conversations):
        raise ValueError("concurrency must be >= 1 and every conversation must have a turn")
    starts = None
    if conversation_rate is not None:
        if not conversation_rate > 0:
            raise ValueError(f"conversation_rate must be > 0, got {conversation_rate}")
        starts = arrival_times(len(conversations), conversation_rate, 1.0, seed)
    options = ServeBenchOptions(url=url, temperature=temperature, ignore_eos=ignore_eos)
    base = url.rstrip("/").removesuffix("/v1")
    endpoint_url = base + ENDPOINTS["completions"]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        model = await first_model_id(session, base)
        for i, request in enumerate(warmups):
            warm = await send_request(session, endpoint_url, request_body(options, model, request), "completions",
                                      i, request, 0.0, time.perf_counter())
            if not warm.success:
                raise RuntimeError(f"warm-up request failed: {warm.error}")
        waiting = list(reversed(range(len(conversations))))  # popped from the end: conversation 0 first
        sent = itertools.count()  # each request's index, in the order sent
        done: list[TurnRecord] = []
        t0 = time.perf_counter()

        async def play(c: int) -> None:
            for turn, request in enumerate(conversations[c]):
                if turn and think_s > 0:
                    await asyncio.sleep(think_s)
                record = await send_request(session, endpoint_url, request_body(options, model, request),
                                            "completions", next(sent), request, time.perf_counter() - t0, t0)
                done.append(TurnRecord(c, turn, record))
                if not record.success:
                    break  # the history the next turn extends was never answered

        async def player() -> None:
            while waiting:
                await play(waiting.pop())

        async def arrival(c: int) -> None:
            await asyncio.sleep(max(0.0, t0 + starts[c] - time.perf_counter()))
            await play(c)

        if starts is None:
            await asyncio.gather(*(player() for _ in range(min(concurrency, len(conversations)))))
        else:
            await asyncio.gather(*(arrival(c) for c in range(len(conversations))))
        duration = time.perf_counter() - t0
    return ConversationReplay(model, duration, done)


def summarize_turns(replay: ConversationReplay, percentiles=DEFAULT_PERCENTILES) -> dict[str, dict]:
    """vLLM-style summaries of every request (``all``), of first turns and of later turns,
    each over the whole run's duration."""
    groups = {"all": [t.record for t in replay.turns],
              "first_turns": [t.record for t in replay.turns if t.turn == 0],
              "later_turns": [t.record for t in replay.turns if t.turn > 0]}
    return {name: summarize(records, replay.duration_s, percentiles=percentiles)
            for name, records in groups.items() if records}
