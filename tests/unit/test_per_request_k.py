"""k per request: each request drafts as deep as its own acceptance pays, and outputs stay the target's."""

from __future__ import annotations

import pytest

from cluster.shared.request import Request
from cluster.shared.sampling_params import SamplingParams
from cluster.spec_decode.latency_model import LatencyModel
from cluster.spec_decode.per_request_k import record_verified, request_acceptance, split_k

# A step costs 10 ms plus 1 ms per verified token at batch 4; each draft pass 0.5 ms.
MODEL = LatencyModel([0.010, 0.0, 0.001], [0.0005, 0.0])


def test_requests_that_accept_more_draft_deeper():
    ks = split_k(MODEL, 6, [6, 6, 6, 6], [[0.95] * 6, [0.8] * 6, [0.4] * 6, [0.05] * 6])
    assert ks[0] >= ks[1] > ks[2] >= ks[3]
    assert ks[0] == 6 and ks[3] == 1  # at least one: the request's acceptance stays observed


def test_alike_requests_get_alike_k_and_asked_is_a_cap():
    ks = split_k(MODEL, 4, [4, 4, 2, 0], [[0.7] * 4] * 4)
    assert ks[0] == ks[1] and ks[2] <= 2 and ks[3] == 0
    assert split_k(MODEL, 0, [0, 0], [[0.9], [0.9]]) == [0, 0]


def test_a_position_pays_when_its_gain_beats_what_it_costs():
    """Where verifying costs nothing extra, every position pays; where a token costs as much as a
    step, none does."""
    free = LatencyModel([0.010, 0.0, 0.0], [0.0, 0.0])
    assert split_k(free, 5, [5, 5], [[0.3] * 5, [0.1] * 5]) == [5, 5]
    dear = LatencyModel([0.0, 0.0, 0.010], [0.0, 0.0])
    assert split_k(dear, 5, [5, 5], [[0.3] * 5, [0.1] * 5]) == [1, 1]


def test_a_requests_history_moves_its_acceptance_from_the_batchs():
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=8), None)
    assert request_acceptance(request, [0.5, 0.5]) == [0.5, 0.5]
    for _ in range(12):
        record_verified(request, asked=2, accepted=2)
    high = request_acceptance(request, [0.5, 0.5])
    assert high[0] > 0.85 and high[1] > 0.85
    other = Request("s", [1, 2, 3], SamplingParams(max_tokens=8), None)
    for _ in range(12):
        record_verified(other, asked=2, accepted=0)
    low = request_acceptance(other, [0.5, 0.5])
    assert low[0] < 0.15 and low[1] == 0.5  # position 2 was never reached


def test_per_request_k_needs_the_adaptive_controller(tiny_llama_dir):
    from tests.engine_helpers import make_engine

    with pytest.raises(ValueError, match="per_request_k needs controller: adaptive"):
        make_engine(tiny_llama_dir, method="ngram", per_request_k=True)
