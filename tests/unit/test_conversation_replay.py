"""Multi-turn replay (``cluster/bench/conversation_replay.py``) against the fake OpenAI server of
``test_bench_serve``: each turn leaves after the answer before it, at most ``concurrency``
conversations at once, first and later turns summarized apart. No timing assertions."""

from __future__ import annotations

import asyncio

import pytest

from cluster.bench.conversation_replay import replay_conversations, summarize_turns
from cluster.bench.serve_workload import BenchRequest
from tests.unit.test_bench_serve import fake  # noqa: F401  (the fixture: a fake server on a free port)


def _conversation(c: int, turns: int) -> list[BenchRequest]:
    history = f"c{c}"
    requests = []
    for t in range(turns):
        history += f" turn{t} words here"
        requests.append(BenchRequest(history, 3 + t, len(history.split())))
    return requests


def test_turns_wait_for_the_answer_before_them(fake):
    conversations = [_conversation(c, turns) for c, turns in enumerate([3, 1, 4, 2, 3])]
    warm = [BenchRequest("warm up", 2, 2)]
    replay = asyncio.run(replay_conversations(fake.url, conversations, 2, warmups=warm))
    assert replay.model == "fake-model" and fake.max_in_flight <= 2
    assert fake.bodies[0]["prompt"] == "warm up" and len(fake.bodies) == 1 + sum(map(len, conversations))
    assert sorted((t.conversation, t.turn) for t in replay.turns) == [
        (c, t) for c, conv in enumerate(conversations) for t in range(len(conv))]
    for c, conv in enumerate(conversations):
        mine = sorted((t for t in replay.turns if t.conversation == c), key=lambda t: t.turn)
        for before, after in zip(mine, mine[1:]):
            assert after.record.start_s >= before.record.start_s + before.record.e2e_s  # sent after the answer
        assert [t.record.output_len for t in mine] == [r.output_len for r in conv]
        prompts = [b["prompt"] for b in fake.bodies if b["prompt"].startswith(f"c{c} ")]
        assert prompts == [r.prompt for r in conv]  # in the conversation's order
    summaries = summarize_turns(replay)
    assert summaries["first_turns"]["completed"] == 5
    assert summaries["later_turns"]["completed"] == sum(map(len, conversations)) - 5
    assert summaries["all"]["completed"] == sum(map(len, conversations))


def test_a_failed_turn_ends_its_conversation_only(fake):
    conversations = [[BenchRequest("a0", 2, 1), BenchRequest("a0 BAD", 2, 2), BenchRequest("a0 BAD more", 2, 3)],
                     [BenchRequest("b0", 2, 1), BenchRequest("b0 b1", 2, 2)]]
    replay = asyncio.run(replay_conversations(fake.url, conversations, 1))
    assert [(t.conversation, t.turn, t.record.success) for t in replay.turns] == [
        (0, 0, True), (0, 1, False), (1, 0, True), (1, 1, True)]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="concurrency"):
        asyncio.run(replay_conversations("http://127.0.0.1:9", [[BenchRequest("x", 1, 1)]], 0))
    with pytest.raises(ValueError, match="every conversation"):
        asyncio.run(replay_conversations("http://127.0.0.1:9", [[]], 1))


def test_conversations_arriving_at_a_rate_all_start_and_keep_their_order(fake):
    conversations = [_conversation(c, 3) for c in range(6)]
    replay = asyncio.run(replay_conversations(fake.url, conversations, 1, conversation_rate=1e6, seed=3))
    assert sorted((t.conversation, t.turn) for t in replay.turns) == [(c, t) for c in range(6) for t in range(3)]
    assert fake.max_in_flight > 1  # all arrive at once: the open loop ignores the concurrency of 1
    for c in range(6):
        mine = sorted((t for t in replay.turns if t.conversation == c), key=lambda t: t.turn)
        for before, after in zip(mine, mine[1:]):
            assert after.record.start_s >= before.record.start_s + before.record.e2e_s
    with pytest.raises(ValueError, match="conversation_rate"):
        asyncio.run(replay_conversations(fake.url, conversations, 1, conversation_rate=0.0))
