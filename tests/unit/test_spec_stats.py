"""Speculative decoding counters: vLLM's (over proposed tokens) and the latency model's
(over the positions asked for)."""

from __future__ import annotations

import pytest

from cluster.routing.policy import expected_tokens_per_step
from cluster.spec_decode.stats import SpecDecodeStats


def test_positions_asked_for_but_not_proposed_count_as_rejected_only_in_the_effective_rate():
    stats = SpecDecodeStats()
    stats.record_request(2, 2, num_asked=4)  # lookup matched near the end: 2 of 4 proposed, both accepted
    stats.record_request(0, 0, num_asked=4)  # no match: nothing proposed
    stats.record_request(4, 1, num_asked=4)  # all proposed, the first accepted
    # vLLM's counters see only the proposals
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 3)
    assert stats.conditional_acceptance == [1.0, 0.5, 0.0, 0.0]
    # over the positions asked for: position 0 was reached by all 3 and accepted by 2,
    # position 1 reached by 2 and accepted by 1, position 2 reached by 2 (one not proposed)
    assert stats.asked_per_position == [3, 3, 3, 3]
    assert stats.effective_acceptance == pytest.approx([2 / 3, 1 / 2, 0.0, 0.0])
    assert stats.coverage == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1 / 3])


def test_the_effective_rate_gives_the_tokens_gained_per_step_that_routers_use():
    stats = SpecDecodeStats()
    steps = [(2, 2), (0, 0), (4, 1), (3, 3)]  # (proposed, accepted) of 4 positions asked for each
    for proposed, accepted in steps:
        stats.record_request(proposed, accepted, num_asked=4)
    gained = sum(accepted + 1 for _, accepted in steps) / len(steps)  # 10 tokens over 4 steps
    assert stats.effective_acceptance_rate == pytest.approx(6 / 16)
    assert expected_tokens_per_step(stats.effective_acceptance_rate, 4) == pytest.approx(gained)
    # vLLM's rate (accepted / proposed) would promise more than lookup delivered
    assert expected_tokens_per_step(stats.acceptance_rate, 4) > gained + 1
    assert SpecDecodeStats().effective_acceptance_rate == 0.0


def test_full_proposals_give_the_same_rate_either_way():
    stats = SpecDecodeStats()
    for accepted in (0, 1, 3, 3, 2):
        stats.record_request(3, accepted)  # num_asked defaults to what was proposed
    assert stats.effective_acceptance == pytest.approx(stats.conditional_acceptance)
    assert stats.effective_acceptance_rate == pytest.approx(stats.acceptance_rate)
    assert stats.coverage == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("proposed, accepted, asked", [(3, 1, 2), (2, 3, 4), (2, -1, 2)])
def test_inconsistent_counts_are_refused(proposed, accepted, asked):
    with pytest.raises(ValueError, match="inconsistent draft counts"):
        SpecDecodeStats().record_request(proposed, accepted, num_asked=asked)
