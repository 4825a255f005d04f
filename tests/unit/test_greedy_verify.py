"""Greedy verification without distributions: the same tokens as rejection sampling's greedy rows."""

from __future__ import annotations

import pytest
import torch

from cluster.spec.rejection import greedy_verify, rejection_sample


def test_hand_cases():
    # Request 0: 3 drafts, the second differs from the target -> 1 accepted, the target's token.
    # Request 1: 2 drafts, both match -> both accepted plus the bonus.
    # Request 2: no drafts -> plain greedy decoding.
    out = greedy_verify([[5, 6, 7], [8, 9], []], [5, 4, 7, 1, 8, 9, 3, 2])
    assert out.output_token_ids == [[5, 4], [8, 9, 3], [2]]
    assert out.num_accepted == [1, 2, 0]


def test_matches_rejection_samplings_greedy_rows():
    gen = torch.Generator().manual_seed(0)
    vocab = 11
    for _ in range(200):
        num_reqs = int(torch.randint(1, 6, (1,), generator=gen))
        counts = torch.randint(0, 5, (num_reqs,), generator=gen).tolist()
        max_k = max(counts)
        target_ids = torch.randint(0, vocab, (num_reqs, max_k + 1), generator=gen)
        drafts = torch.randint(0, vocab, (num_reqs, max_k), generator=gen)
        # Make long accepted runs likely: copy the target's tokens into most draft positions.
        copy = torch.rand(num_reqs, max_k, generator=gen) < 0.7
        drafts = torch.where(copy, target_ids[:, :max_k], drafts)
        one_hot = torch.nn.functional.one_hot(target_ids, vocab).float()
        reference = rejection_sample(drafts, counts, None, one_hot, torch.ones(num_reqs, dtype=torch.bool), {})
        flat = [t for i, n in enumerate(counts) for t in target_ids[i, : n + 1].tolist()]
        out = greedy_verify([drafts[i, :n].tolist() for i, n in enumerate(counts)], flat)
        assert out == reference


def test_wrong_number_of_target_ids_is_refused():
    with pytest.raises(ValueError, match="k_i \\+ 1 per request"):
        greedy_verify([[1, 2]], [1, 2])
