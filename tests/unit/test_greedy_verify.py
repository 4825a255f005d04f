"""Verification paths beside the padded one: greedy on the host, and packed distributions."""

from __future__ import annotations

import pytest
import torch

from cluster.runner.random_stream import SeedKey
from cluster.runner.rejection import greedy_verify, rejection_sample, rejection_sample_packed


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


def test_matches_rejection_samplings_greedy_rows():
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
        one_hot = torch.nn.functional.one_hot(target_ids, vocab).float()
        reference = rejection_sample(drafts, counts, None, one_hot, torch.ones(num_reqs, dtype=torch.bool), {})
        flat = [t for i, n in enumerate(counts) for t in target_ids[i, : n + 1].tolist()]
        out = greedy_verify([drafts[i, :n].tolist() for i, n in enumerate(counts)], flat)
        assert out == reference


def test_wrong_number_of_target_ids_is_refused():
    with pytest.raises(ValueError, match="k_i \\+ 1 per request"):
        greedy_verify([[1, 2]], [1, 2])


@pytest.mark.parametrize("coupled", [False, True])
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_packed_distributions_give_the_padded_results(with_draft_probs, coupled):
    """rejection_sample_packed reads the same rows rejection_sample reads from padded tensors:
    the same tokens for the same random draws (greedy, unseeded and seeded rows mixed; seeded
    rows verified by rejection sampling or by coupling)."""
    gen = torch.Generator().manual_seed(1)
    vocab = 7
    for trial in range(100):
        counts = _random_counts(gen)
        num_reqs, max_k = len(counts), max(counts)
        drafts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in counts]
        target = [torch.rand(n + 1, vocab, generator=gen) for n in counts]
        draft = [torch.rand(n, vocab, generator=gen) for n in counts] if with_draft_probs else None
        greedy = torch.rand(num_reqs, generator=gen) < 0.3
        seeded_rows = [i for i in range(num_reqs) if torch.rand(1, generator=gen) < 0.3]

        padded_ids = torch.zeros(num_reqs, max_k, dtype=torch.int64)
        padded_target = torch.rand(num_reqs, max_k + 1, vocab, generator=gen)  # padding holds noise
        padded_draft = torch.rand(num_reqs, max_k, vocab, generator=gen) if with_draft_probs else None
        for i, n in enumerate(counts):
            padded_ids[i, :n] = torch.tensor(drafts[i], dtype=torch.int64)
            padded_target[i, : n + 1] = target[i]
            if with_draft_probs:
                padded_draft[i, :n] = draft[i]

        def run(sample, *args):
            torch.manual_seed(trial)
            seeded = {i: SeedKey(100 + i, trial) for i in seeded_rows}
            return sample(*args, greedy, seeded, coupled)

        want = run(rejection_sample, padded_ids, counts, padded_draft, padded_target)
        got = run(rejection_sample_packed, drafts, torch.cat(draft) if with_draft_probs else None, torch.cat(target))
        assert got == want


def test_packed_shapes_are_checked():
    with pytest.raises(ValueError, match="target_probs must be"):
        rejection_sample_packed([[1, 2]], None, torch.rand(2, 5), torch.zeros(1, dtype=torch.bool), {})
    with pytest.raises(ValueError, match="draft_probs must be"):
        rejection_sample_packed([[1, 2]], torch.rand(3, 5), torch.rand(3, 5), torch.zeros(1, dtype=torch.bool), {})
    with pytest.raises(ValueError, match="greedy must be"):
        rejection_sample_packed([[1, 2]], None, torch.rand(3, 5), torch.zeros(2, dtype=torch.bool), {})
