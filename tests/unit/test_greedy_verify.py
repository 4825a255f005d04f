"""Greedy verification on the host (``greedy_verify``), held against the one-request reference and
the batched sampler's greedy fast path."""

from __future__ import annotations

import pytest
import torch

from cluster.runner.rejection import greedy_verify, rejection_sample
from tests.speculative_reference import greedy_verify_one


def test_hand_cases():
    # Request 0: 3 drafts, the second differs from the target -> 1 accepted, the target's token.
    # Request 1: 2 drafts, both match -> both accepted plus the bonus.
    # Request 2: no drafts -> plain greedy decoding.
    out = greedy_verify([[5, 6, 7], [8, 9], []], [5, 4, 7, 1, 8, 9, 3, 2])
    assert out.output_token_ids == [[5, 4], [8, 9, 3], [2]]
    assert out.num_accepted == [1, 2, 0]


def _random_counts(gen: torch.Generator) -> list[int]:
    """Draft counts of a random batch: 1-5 requests with 0-4 drafts each."""
    num_reqs = int(torch.randint(1, 6, (1,), generator=gen))
    return torch.randint(0, 5, (num_reqs,), generator=gen).tolist()


def test_matches_the_reference_and_the_samplers_greedy_rows():
    gen = torch.Generator().manual_seed(0)
    vocab = 11
    for _ in range(200):
        counts = _random_counts(gen)
        num_reqs, max_k = len(counts), max(counts)
        target_ids = torch.randint(0, vocab, (num_reqs, max_k + 1), generator=gen)
        drafts = torch.randint(0, vocab, (num_reqs, max_k), generator=gen)
        # Make long accepted runs likely: copy the target's tokens into most draft positions.
        copy = torch.rand(num_reqs, max_k, generator=gen) < 0.7
        drafts = torch.where(copy, target_ids[:, :max_k], drafts)
        one_hot = torch.nn.functional.one_hot(target_ids, vocab).float()  # [num_reqs, max_k + 1, vocab]
        lists = [drafts[i, :n].tolist() for i, n in enumerate(counts)]
        want = [greedy_verify_one(lists[i], one_hot[i, : n + 1]) for i, n in enumerate(counts)]
        flat = [t for i, n in enumerate(counts) for t in target_ids[i, : n + 1].tolist()]
        out = greedy_verify(lists, flat)
        assert (out.output_token_ids, out.num_accepted) == ([ids for ids, _ in want], [n for _, n in want])
        sampled = rejection_sample(lists, None, torch.cat([one_hot[i, : n + 1] for i, n in enumerate(counts)]),
                                   torch.ones(num_reqs, dtype=torch.bool), {})
        assert sampled == out


def test_wrong_number_of_target_ids_is_refused():
    with pytest.raises(ValueError, match="k_i \\+ 1 per request"):
        greedy_verify([[1, 2]], [1, 2])


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="target_probs must be"):
        rejection_sample([[1, 2]], None, torch.rand(2, 5), torch.zeros(1, dtype=torch.bool), {})
    with pytest.raises(ValueError, match="draft_probs must be"):
        rejection_sample([[1, 2]], torch.rand(3, 5), torch.rand(3, 5), torch.zeros(1, dtype=torch.bool), {})
    with pytest.raises(ValueError, match="greedy must be"):
        rejection_sample([[1, 2]], None, torch.rand(3, 5), torch.zeros(2, dtype=torch.bool), {})
