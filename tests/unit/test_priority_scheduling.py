"""scheduler.policy priority (vLLM's scheduling_policy): waiting requests by priority, then arrival;
the lowest-priority running request is the one preempted; outputs stay those of a roomy pool. A
first-come-first-served engine refuses a priority, naming it."""

from __future__ import annotations

import pytest

from cluster.errors import ParamError
from cluster.shared.sampling_params import SamplingParams
from tests.engine_helpers import make_engine, run_to_completion


def _params(priority: int, max_tokens: int = 3) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, priority=priority)


def _finish_order(engine, priorities: list[int]) -> list[int]:
    ids = [engine.add_request([5 + i, 9, 17, 33], _params(p)) for i, p in enumerate(priorities)]
    order = []
    while engine.has_unfinished():
        order += [ids.index(out.request_id) for out in engine.step() if out.finished]
        engine.check_invariants()
    return order


@pytest.mark.parametrize("policy, expected", [("priority", [3, 1, 0, 2]), ("fcfs", [0, 1, 2, 3])])
def test_one_at_a_time_requests_are_served_in_priority_order(tiny_llama_dir, policy, expected):
    """One running request at a time: priority serves -1, 0, then the two 5s in arrival order."""
    engine = make_engine(tiny_llama_dir, dtype="float32", num_blocks=32, max_num_seqs=1, policy=policy)
    priorities = [5, 0, 5, -1] if policy == "priority" else [0, 0, 0, 0]
    assert _finish_order(engine, priorities) == expected


def test_the_lowest_priority_running_request_is_preempted(tiny_llama_dir):
    """Three 16-token prompts in four blocks of 16: when the decodes need blocks, first come first
    served preempts the newest request, priority the one of priority 9, scheduled first in that
    step; the outputs equal a roomy pool's either way, invariants hold every step."""
    prompts = [[3 + (7 * i + j) % 200 for j in range(16)] for i in range(3)]
    params = [_params(9, 6), _params(0, 6), _params(0, 6)]
    roomy = run_to_completion(make_engine(tiny_llama_dir, dtype="float32", num_blocks=64, policy="priority"),
                              prompts, params)
    for policy, victim in (("fcfs", 2), ("priority", 0)):
        engine = make_engine(tiny_llama_dir, dtype="float32", num_blocks=4, block_size=16, policy=policy)
        sent = params if policy == "priority" else [_params(0, 6)] * 3
        preempted = []
        original = engine.scheduler._preempt

        def record(request, out, original=original):
            preempted.append(request.prompt_token_ids)
            return original(request, out)

        engine.scheduler._preempt = record
        assert run_to_completion(engine, prompts, sent) == roomy
        assert preempted and preempted[0] == prompts[victim]


def test_a_first_come_first_served_engine_refuses_a_priority(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, dtype="float32", num_blocks=16)
    with pytest.raises(ParamError, match="scheduler.policy: priority") as err:
        engine.add_request([1, 2, 3], _params(2))
    assert err.value.param == "priority"
    engine.add_request([1, 2, 3], _params(0))  # the default is served
