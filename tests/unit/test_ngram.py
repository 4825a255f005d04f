"""N-gram proposer: hand-made cases, a brute-force reference on random sequences, bad args."""

from __future__ import annotations

import random

import numpy as np
import pytest

from cluster.spec_decode.ngram import NgramProposer


def reference_propose(token_ids: list[int], num_draft_tokens: int, min_n: int, max_n: int,
                      draft_per_match_token: float | None = None) -> list[int]:
    """Plain loops, straight from the definition."""
    seq_len = len(token_ids)
    for n in range(max_n, min_n - 1, -1):
        if seq_len < n + 1:
            continue
        suffix = token_ids[seq_len - n :]
        for start in range(seq_len - n - 1, -1, -1):  # match ends at start + n - 1 <= seq_len - 2
            if token_ids[start : start + n] == suffix:
                limit = num_draft_tokens
                if draft_per_match_token is not None and n < max_n:
                    limit = min(limit, int(draft_per_match_token * n))
                return token_ids[start + n : start + n + limit]
    return []


def test_repeated_phrase_proposes_continuation():
    proposer = NgramProposer(min_n=1, max_n=3)
    tokens = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    assert proposer.propose_one(tokens, 3) == [8, 9, 1]


def test_prefers_longest_n():
    # Suffix [3, 4]: n=2 matches at the start (-> 9), n=1 alone would pick the later 4 (-> 7).
    proposer = NgramProposer(min_n=1, max_n=2)
    tokens = [3, 4, 9, 4, 7, 3, 4]
    assert proposer.propose_one(tokens, 1) == [9]
    assert NgramProposer(min_n=1, max_n=1).propose_one(tokens, 1) == [7]


def test_picks_most_recent_occurrence():
    proposer = NgramProposer(min_n=2, max_n=2)
    tokens = [1, 2, 10, 1, 2, 20, 1, 2, 30, 1, 2]
    assert proposer.propose_one(tokens, 1) == [30]


def test_no_match_proposes_nothing():
    proposer = NgramProposer(min_n=1, max_n=4)
    assert proposer.propose_one([1, 2, 3, 4, 5], 4) == []
    # Longer n-grams may not fall back below min_n.
    assert NgramProposer(min_n=2, max_n=4).propose_one([1, 2, 3, 9, 3], 4) == []


def test_proposal_truncated_at_sequence_end():
    proposer = NgramProposer(min_n=1, max_n=2)
    # Suffix [1, 2] matches at index 3 (overlapping nothing): only [7, 1, 2] follow it.
    assert proposer.propose_one([9, 9, 9, 1, 2, 7, 1, 2], 10) == [7, 1, 2]
    # The match may overlap the suffix; the proposal runs into it and stops at the end.
    assert proposer.propose_one([4, 4, 4, 4], 5) == [4]


def test_zero_draft_tokens_and_short_sequences():
    proposer = NgramProposer(min_n=2, max_n=3)
    assert proposer.propose_one([1, 2, 1, 2], 0) == []
    assert proposer.propose_one([], 3) == []
    assert proposer.propose_one([7, 7], 3) == []  # shorter than min_n + 1
    assert proposer.propose_one([7, 7, 7], 3) == [7]


def test_batch_equals_per_sequence():
    rng = random.Random(7)
    proposer = NgramProposer(min_n=1, max_n=3)
    batch = [[rng.randrange(4) for _ in range(rng.randrange(0, 60))] for _ in range(20)]
    num_draft_tokens = [rng.randrange(0, 6) for _ in batch]
    expected = [proposer.propose_one(ids, k) for ids, k in zip(batch, num_draft_tokens)]
    assert proposer.propose(batch, num_draft_tokens) == expected
    assert proposer.propose([], []) == []


def test_accepts_numpy_input_and_returns_python_ints():
    proposer = NgramProposer(min_n=1, max_n=2)
    out = proposer.propose_one(np.array([1, 2, 3, 1, 2], dtype=np.int32), 2)
    assert out == [3, 1] and all(type(t) is int for t in out)


@pytest.mark.parametrize("ratio", [None, 0.5, 1.0, 2.0])
@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 2), (1, 4), (2, 3), (2, 5), (3, 3), (4, 6)])
def test_matches_brute_force_reference(min_n, max_n, ratio):
    rng = random.Random(1000 * min_n + max_n)
    proposer = NgramProposer(min_n=min_n, max_n=max_n, draft_per_match_token=ratio)
    for _ in range(300):
        alphabet = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 80))]
        k = rng.randrange(0, 8)
        assert proposer.propose_one(tokens, k) == reference_propose(tokens, k, min_n, max_n, ratio), (
            tokens,
            k,
        )


def test_short_matches_draft_fewer_tokens():
    # The suffix [5, 6, 7] matches 3 tokens (max_n 4): at most 3 drafts at one per matched token.
    tokens = [5, 6, 7, 1, 2, 3, 4, 8, 9, 5, 6, 7]
    assert NgramProposer(1, 4).propose_one(tokens, 6) == [1, 2, 3, 4, 8, 9]  # no cap: all k
    assert NgramProposer(1, 4, draft_per_match_token=1.0).propose_one(tokens, 6) == [1, 2, 3]
    assert NgramProposer(1, 4, draft_per_match_token=1.5).propose_one(tokens, 6) == [1, 2, 3, 4]
    assert NgramProposer(1, 4, draft_per_match_token=1.0).propose_one(tokens, 2) == [1, 2]  # k still caps
    # A 1-token match at 0.5 per matched token drafts nothing; a full max_n match drafts all k.
    assert NgramProposer(1, 4, draft_per_match_token=0.5).propose_one([3, 1, 2, 3], 4) == []
    assert NgramProposer(1, 3, draft_per_match_token=0.5).propose_one(tokens, 6) == [1, 2, 3, 4, 8, 9]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"min_n": 0}, "1 <= min_n <= max_n"),
        ({"min_n": 3, "max_n": 2}, "min_n=3, max_n=2"),
        ({"max_n": 0}, "1 <= min_n <= max_n"),
        ({"min_n": 1.5}, "min_n must be an int"),
        ({"max_n": True}, "max_n must be an int"),
        ({"draft_per_match_token": -1.0}, "draft_per_match_token must be >= 0"),
        ({"draft_per_match_token": float("nan")}, "draft_per_match_token must be >= 0"),
    ],
)
def test_bad_constructor_args(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NgramProposer(**kwargs)


def test_bad_call_args():
    proposer = NgramProposer()
    with pytest.raises(ValueError, match="num_draft_tokens must be >= 0"):
        proposer.propose_one([1, 2, 1], -1)
    with pytest.raises(ValueError, match="must be equal"):
        proposer.propose([[1, 2]], [1, 2])
