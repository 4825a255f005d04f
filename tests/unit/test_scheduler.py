"""Scheduler and block manager on their own: no model, no torch."""

from __future__ import annotations

import pytest

from cluster.config import SchedulerConfig
from cluster.shared.request import Request, RequestStatus
from cluster.shared.sampled import SampledTokens
from cluster.shared.sampling_params import SamplingParams
from cluster.engine.scheduler import Scheduler
from cluster.kv.block_manager import BlockManager


def _request(rid: str, prompt_len: int, max_tokens: int = 8) -> Request:
    return Request(rid, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=max_tokens), eos_token_id=2)


def _scheduler(num_blocks=16, block_size=4, **kwargs) -> Scheduler:
    config = SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 64, **kwargs})
    return Scheduler(config, BlockManager(num_blocks, block_size), max_model_len=256)


def _run_step(s: Scheduler, token: int = 7):
    out = s.schedule()
    sampled = {x.request.request_id: SampledTokens([token], None, 0) for x in out.scheduled if x.samples}
    finished = s.update(out, sampled)
    s.check_invariants()
    return out, finished


def test_block_manager_allocates_lookahead_and_frees():
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.allocate_slots("a", 0, 5)  # 2 blocks
    assert bm.allocate_slots("a", 5, 1, num_lookahead_tokens=3)  # 9 tokens -> 3 blocks
    assert len(bm.get_block_table("a")) == 3
    assert not bm.allocate_slots("b", 0, 8)  # needs 2, 1 free: refused, nothing taken
    assert bm.num_free_blocks == 1
    bm.check_invariants()
    bm.free("a")
    assert bm.num_free_blocks == 4
    bm.check_invariants()
    bm.free("a")  # freeing twice is a no-op for the manager
    bm.check_invariants()


def test_chunked_prefill_respects_the_token_budget():
    s = _scheduler(max_num_batched_tokens=10)
    s.add_request(_request("a", 25))
    sizes = []
    while True:
        out, _ = _run_step(s)
        sizes.append(out.num_batched_tokens)
        if s.requests["a"].num_output_tokens:
            break
    assert sizes == [10, 10, 5]


def test_decode_and_prefill_share_a_step():
    s = _scheduler(max_num_batched_tokens=16, waiting_served_ratio=0)
    s.add_request(_request("a", 4))
    _run_step(s)  # a's prefill, first token
    s.add_request(_request("b", 30))
    out, _ = _run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 15)]


def _other_prompt(rid: str, prompt_len: int) -> Request:
    """A prompt sharing no prefix with ``_request``'s (so nothing of it is cached)."""
    return Request(rid, list(range(500, 500 + prompt_len)), SamplingParams(max_tokens=8), eos_token_id=2)


def test_beside_decodes_prompts_get_at_most_the_cap_together():
    s = _scheduler(num_blocks=32, max_num_batched_tokens=64, max_prompt_tokens_beside_decodes=12)
    s.add_request(_request("b", 30))
    out, _ = _run_step(s)  # alone: the whole budget, no cap
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("b", 30)]
    s.add_request(_other_prompt("c", 40))
    out, _ = _run_step(s)  # b decodes now: c's prompt comes 12 tokens a step
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("b", 1), ("c", 12)]
    out, _ = _run_step(s)  # c is running mid-prompt: still capped while b decodes
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("b", 1), ("c", 12)]
    s.add_request(Request("d", list(range(700, 720)), SamplingParams(max_tokens=8), eos_token_id=2))
    out, _ = _run_step(s)  # c takes all 12: d waits
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("b", 1), ("c", 12)]
    out, _ = _run_step(s)  # two prompts beside b share the 12: c takes its last 4, d the other 8
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("b", 1), ("c", 4), ("d", 8)]


def test_without_the_cap_a_prompt_beside_decodes_takes_what_the_budget_leaves():
    s = _scheduler(num_blocks=32, max_num_batched_tokens=64)
    s.add_request(_request("b", 30))
    _run_step(s)
    s.add_request(_other_prompt("c", 40))
    out, _ = _run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("b", 1), ("c", 40)]


def test_finished_requests_leave_and_waiting_ones_take_their_place():
    s = _scheduler(max_num_seqs=1)
    s.add_request(_request("a", 3, max_tokens=2))
    s.add_request(_request("b", 3, max_tokens=2))
    seen = []
    for _ in range(6):
        out, finished = _run_step(s)
        seen.append([x.request.request_id for x in out.scheduled])
        if not s.has_unfinished():
            break
    assert seen == [["a"], ["a"], ["b"], ["b"]]


def test_preemption_takes_the_newest_and_it_is_recomputed():
    s = _scheduler(num_blocks=4, block_size=4)
    s.add_request(_request("old", 8, max_tokens=20))
    s.add_request(Request("new", list(range(500, 508)), SamplingParams(max_tokens=20), eos_token_id=2))
    _run_step(s)  # both prefilled: 2 blocks each, pool full
    out, _ = _run_step(s)  # old's 9th token needs a 3rd block -> new is preempted
    assert [r.request_id for r in out.preempted] == ["new"]
    new = s.requests["new"]
    assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert s.waiting[0] is new and new.num_output_tokens == 1


def test_waiting_served_ratio_batches_admissions():
    s = _scheduler(waiting_served_ratio=1.0)
    for rid in "abcd":
        s.add_request(_request(rid, 2, max_tokens=50))
    _run_step(s)  # nothing running: all four admitted
    s.add_request(_request("e", 2))
    out, _ = _run_step(s)
    assert "e" not in [x.request.request_id for x in out.scheduled]  # 1 waiting < 4 running * 1.0
    for rid in "fgh":
        s.add_request(_request(rid, 2))
    out, _ = _run_step(s)  # 4 waiting >= 4 running: admitted
    assert {"e", "f", "g", "h"} <= {x.request.request_id for x in out.scheduled}


def test_waiting_request_is_admitted_after_max_waiting_steps():
    s = _scheduler(waiting_served_ratio=10.0)
    s.max_waiting_steps = 3
    s.add_request(_request("a", 2, max_tokens=50))
    _run_step(s)
    s.add_request(_request("b", 2))
    admitted_at = None
    for step in range(6):
        out, _ = _run_step(s)
        if "b" in [x.request.request_id for x in out.scheduled]:
            admitted_at = step
            break
    assert admitted_at == 3


def test_abort_frees_blocks_at_once():
    s = _scheduler()
    s.add_request(_request("a", 9))
    s.add_request(_request("b", 9))
    _run_step(s)
    used = s.block_manager.pool.num_used_blocks
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert s.block_manager.pool.num_used_blocks == used - 3
    s.check_invariants()
    assert s.finish_request("a", RequestStatus.FINISHED_ABORTED) is None


def test_duplicate_request_id_is_refused():
    s = _scheduler()
    s.add_request(_request("a", 3))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(_request("a", 3))


def test_bad_word_bans_follow_the_output():
    request = Request("r", [1, 2], SamplingParams(), eos_token_id=0)
    request.bad_words_token_ids = [[7], [3, 4], [5, 6, 8]]
    assert request.bad_word_bans() == [7]
    request.append_output_token_ids([3])
    assert request.bad_word_bans() == [7, 4]
    request.append_output_token_ids([5, 6])
    assert request.bad_word_bans() == [7, 8]
    request.append_output_token_ids([6])
    assert request.bad_word_bans() == [7]
