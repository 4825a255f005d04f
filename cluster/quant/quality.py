"""How much a quantized model differs from its full-precision self, measured.

Two measures, both teacher-forced (every model sees the same token sequence):

* **top-1 agreement**: the share of positions where the two models' most likely next
  token is the same. Sequences are the fixed prompts followed by the reference model's
  own greedy continuation, and only the continuation's positions count.
* **perplexity** on a small English text that ships with the project
  (``data/perplexity.txt``), split into windows of at most ``window`` tokens.

Both read logits straight from a :class:`~cluster.runner.worker.Worker`'s runner over a
private block table, so no scheduler or sampler is involved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from cluster.runner.input_batch import SeqChunk

PERPLEXITY_TEXT = Path(__file__).parent / "data" / "perplexity.txt"


@dataclass(frozen=True)
class QualityReport:
    top1_agreement: float  # share of continuation positions with the same argmax as the reference
    num_agreement_tokens: int
    perplexity: float
    reference_perplexity: float
    num_perplexity_tokens: int

    @property
    def perplexity_change(self) -> float:
        """Relative change against the reference: 0.01 = 1% higher perplexity."""
        return self.perplexity / self.reference_perplexity - 1.0


def sequence_logits(worker, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab_size] float32: the next-token logits after every prefix.
    Uses the first blocks of the worker's KV pool, which must hold no live request."""
    runner = worker.runner
    block_size = runner.spec.block_size
    num_blocks = -(-len(token_ids) // block_size)
    if num_blocks > runner.num_blocks:
        raise ValueError(f"a sequence of {len(token_ids)} tokens needs {num_blocks} KV blocks; "
                         f"the pool has {runner.num_blocks}")
    chunk = SeqChunk(list(token_ids), 0, len(token_ids))
    return runner.forward_logits([chunk], [list(range(num_blocks))])


def greedy_continuations(worker, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Each prompt followed by ``num_tokens`` greedy tokens of ``worker``'s model
    (recomputed from scratch per token: slow, but exact and independent of the engine)."""
    sequences = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(num_tokens):
            ids.append(int(sequence_logits(worker, ids)[-1].argmax()))
        sequences.append(ids)
    return sequences


def top1_agreement(reference, candidate, sequences: list[list[int]], prompt_lens: list[int]) -> tuple[int, int]:
    """(agreeing positions, positions) over the continuation part of every sequence."""
    agree = total = 0
    for ids, start in zip(sequences, prompt_lens):
        ref = sequence_logits(reference, ids)[start - 1: -1].argmax(dim=-1)
        got = sequence_logits(candidate, ids)[start - 1: -1].argmax(dim=-1)
        agree += int((ref == got).sum())
        total += ref.numel()
    return agree, total


def perplexity(worker, token_ids: list[int], window: int) -> float:
    """exp(mean NLL) of ``token_ids[1:]``, windows of ``window`` tokens (each window's
    first token is context only)."""
    nll, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window - 1):
        ids = token_ids[start: start + window]
        if len(ids) < 2:
            break
        logprobs = torch.log_softmax(sequence_logits(worker, ids)[:-1], dim=-1)
        targets = torch.tensor(ids[1:], device=logprobs.device)
        nll -= float(logprobs.gather(1, targets[:, None]).sum())
        count += len(ids) - 1
    return math.exp(nll / count)


def compare(reference, candidate, prompts: list[list[int]], continuation_len: int, text_ids: list[int],
            window: int = 256, sequences: list[list[int]] | None = None) -> QualityReport:
    """Top-1 agreement over ``prompts`` + the reference's greedy continuations (pass
    ``sequences`` to reuse them across candidates) and the perplexity of both on ``text_ids``."""
    if sequences is None:
        sequences = greedy_continuations(reference, prompts, continuation_len)
    agree, total = top1_agreement(reference, candidate, sequences, [len(p) for p in prompts])
    return QualityReport(
        top1_agreement=agree / total, num_agreement_tokens=total,
        perplexity=perplexity(candidate, text_ids, window),
        reference_perplexity=perplexity(reference, text_ids, window),
        num_perplexity_tokens=len(text_ids) - 1,
    )
