"""In-flight prefix sharing: a request whose next block another running request is computing
waits for it and then takes it from the prefix cache, instead of computing it too."""

from __future__ import annotations

import random

from cluster.config import SchedulerConfig
from cluster.engine.scheduler import Scheduler
from cluster.kv.block_manager import BlockManager
from cluster.shared.request import Request, RequestStatus
from cluster.shared.sampled import SampledTokens
from cluster.shared.sampling_params import SamplingParams
from tests.engine_helpers import make_engine, run_to_completion

SHARED = list(range(3, 27))  # 24 tokens: six blocks of 4


def _request(rid: str, tokens: list[int], **params) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=2, **params), eos_token_id=None)


def _scheduler(budget: int = 10) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, waiting_served_ratio=0)
    return Scheduler(config, BlockManager(num_blocks=32, block_size=4), max_model_len=256)


def _step(s: Scheduler) -> dict[str, tuple[int, int]]:
    """One step; (first position, tokens) per request scheduled."""
    out = s.schedule()
    s.update(out, {x.request.request_id: SampledTokens([1], None, 0) for x in out.scheduled if x.samples})
    s.check_invariants()
    return {x.request.request_id: (x.num_computed_tokens, x.num_new_tokens) for x in out.scheduled}


def test_a_request_waits_for_the_prefix_another_is_computing_and_others_go_ahead():
    s = _scheduler()
    s.add_request(_request("leader", SHARED + [90]))
    s.add_request(_request("follower", SHARED + [91, 92]))
    s.add_request(_request("other", [200, 201, 202]))
    steps = [_step(s) for _ in range(4)]
    # The leader computes the prefix 10 tokens a step; the follower waits while the block after its
    # cached prefix is being computed, the unrelated request goes ahead of it meanwhile.
    assert steps[0] == {"leader": (0, 10)}
    assert steps[1] == {"leader": (10, 10)}
    assert "other" in steps[1] or "other" in steps[2]
    assert all("follower" not in step for step in steps[:2])
    # Admitted once the leader has passed the shared blocks it still lacked: only its own rest runs.
    follower_start = next(step["follower"] for step in steps if "follower" in step)
    assert follower_start == (24, 2)
    assert s.requests["follower"].num_cached_tokens == 24
    assert s.num_computed_tokens_total < 2 * len(SHARED)


def test_a_follower_of_an_aborted_leader_computes_the_prefix_itself():
    s = _scheduler()
    s.add_request(_request("leader", SHARED + [90]))
    s.add_request(_request("follower", SHARED + [91]))
    assert _step(s) == {"leader": (0, 10)}
    s.finish_request("leader", RequestStatus.FINISHED_ABORTED)  # its claims go with its blocks
    step = _step(s)
    assert step == {"follower": (8, 10)}  # the two blocks the leader did cache, then its own chunk
    while s.has_unfinished():
        _step(s)
    assert s.block_manager.num_free_blocks == 32


def test_prompt_logprobs_and_a_different_salt_never_wait():
    s = _scheduler(budget=64)
    s.add_request(_request("leader", SHARED + [90]))
    s.add_request(_request("logprobs", SHARED + [91], prompt_logprobs=0))  # its whole prompt runs anyway
    assert _step(s) == {"leader": (0, 25), "logprobs": (0, 25)}
    s = _scheduler(budget=20)
    s.add_request(_request("leader", SHARED + [90]))
    assert _step(s) == {"leader": (0, 20)}
    s.add_request(Request("salted", SHARED + [92], SamplingParams(max_tokens=2), eos_token_id=None, cache_salt="t2"))
    s.add_request(_request("same", SHARED + [93]))
    assert _step(s) == {"leader": (20, 5), "salted": (0, 15)}  # another salt: other blocks
    assert [r.request_id for r in s.waiting] == ["same"]


def test_identical_prompts_sent_together_compute_their_prefix_once(tiny_llama_dir):
    rng = random.Random(4)
    system = [rng.randrange(3, 256) for _ in range(40)]
    prompts = [system + [rng.randrange(3, 256) for _ in range(rng.randint(1, 6))] for _ in range(4)]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    alone = [run_to_completion(make_engine(tiny_llama_dir, num_blocks=64, block_size=4), [p], [greedy])[0]
             for p in prompts]
    engine = make_engine(tiny_llama_dir, num_blocks=64, block_size=4, max_num_batched_tokens=16)
    together = run_to_completion(engine, prompts, [greedy] * len(prompts))
    assert together == alone
    stats = engine.stats()
    assert stats.prefix_cache_hits == 3 * 40  # each follower found the whole system prompt cached
    assert stats.num_computed_tokens <= 40 + sum(len(p) - 40 for p in prompts) + 4 * 6
