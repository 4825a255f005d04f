"""Speculative sampling for one request, written plainly: the reference the batched sampler
(``cluster.runner.rejection``) is held against. One loop over the drafts, one random number
per test, no padding, no batching, no seeds (Leviathan et al. 2023, algorithm 1)."""

from __future__ import annotations

import torch


def speculative_sample(
    draft_ids: list[int],
    draft_probs: torch.Tensor | None,  # [k, vocab_size]; None: deterministic drafts (one-hot)
    target_probs: torch.Tensor,  # [k + 1, vocab_size]
    generator: torch.Generator,
) -> tuple[list[int], int]:
    """The tokens one verification emits (accepted drafts, then one recovered or bonus token)
    and how many drafts were accepted."""
    emitted = []
    for j, x in enumerate(draft_ids):
        target = target_probs[j].double()
        draft = (torch.nn.functional.one_hot(torch.tensor(x), target.numel()).double() if draft_probs is None
                 else draft_probs[j].double())
        keep = 1.0 if target[x] >= draft[x] else (target[x] / draft[x]).item()
        if torch.rand((), generator=generator, dtype=torch.float64).item() < keep:
            emitted.append(x)
            continue
        residual = (target - draft).clamp(min=0)
        if residual.sum() <= 0:  # target == draft: a rejection cannot happen; any draw from the target
            residual = target
        emitted.append(int(torch.multinomial(residual, 1, generator=generator)))
        return emitted, j
    emitted.append(int(torch.multinomial(target_probs[len(draft_ids)].double(), 1, generator=generator)))
    return emitted, len(draft_ids)


def greedy_verify_one(draft_ids: list[int], target_probs: torch.Tensor) -> tuple[list[int], int]:
    """Greedy: accept drafts while each is the target's argmax, then emit the argmax."""
    argmax = target_probs.argmax(dim=-1).tolist()
    for j, x in enumerate(draft_ids):
        if x != argmax[j]:
            return draft_ids[:j] + [argmax[j]], j
    return draft_ids + [argmax[len(draft_ids)]], len(draft_ids)
