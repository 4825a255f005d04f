"""Draft tokens from a small model that shares the target's tokenizer.

The draft has its own paged KV cache with as many blocks as the target's and reads it
through the *same* block tables, so prefix caching, preemption and aborts need no
extra bookkeeping. ``request.draft_num_computed_tokens`` says how far the draft's
cache is valid; each proposal first catches the draft up on the tokens it has not
seen (the whole prompt the first time, then the token(s) the target added), then
runs one batched pass per further draft token. The scheduler lowers the count
to the verified tokens after each step and to 0 on preemption.
"""

from __future__ import annotations

import torch

from cluster.shared.scheduled import ScheduledRequest
from cluster.runner.input_batch import SeqChunk
from cluster.runner.model_runner import ModelRunner
from cluster.runner.random_stream import Lane
from cluster.runner.sampler import compute_probs, sample_from_probs
from cluster.shared.draft_proposal import DraftProposal


def check_vocab_compatible(target_tokenizer, draft_tokenizer, target_vocab: int, draft_vocab: int) -> None:
    """Refuse a draft whose token ids mean something else than the target's."""
    if target_vocab != draft_vocab:
        raise ValueError(
            f"the draft model's vocabulary has {draft_vocab} entries but the target's has {target_vocab}; "
            "a draft must share the target's tokenizer"
        )
    if target_tokenizer is not None and draft_tokenizer is not None:
        if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
            raise ValueError("the draft model's tokenizer differs from the target's; a draft must share it")


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, target: ModelRunner) -> None:
        self.runner = runner
        # Sampling settings and seeds are the target runner's. A seeded draft token for output
        # position p uses p's SAMPLE number when the target couples (then draft and target share
        # it, see cluster.runner.rejection), else its own DRAFT number.
        self.target = target
        self.lane = Lane.SAMPLE if target.coupled else Lane.DRAFT

    def record(self, aux_hidden: dict) -> None:
        pass

    def free(self, request_id: str) -> None:
        pass

    @torch.inference_mode()
    def propose(
        self, scheduled: list[ScheduledRequest], block_tables: list[list[int]]
    ) -> DraftProposal:
        active = [(s, t) for s, t in zip(scheduled, block_tables) if s.num_draft_tokens > 0]
        if not active:
            return DraftProposal({}, {})
        requests = [s.request for s, _ in active]
        tables = [t for _, t in active]
        wanted = [s.num_draft_tokens for s, _ in active]
        drafts: list[list[int]] = [[] for _ in active]
        probs: list[list[torch.Tensor]] = [[] for _ in active]

        # Pass 1 catches up on unseen tokens and drafts the first token.
        chunks = []
        for request in requests:
            start = request.draft_num_computed_tokens
            chunks.append(SeqChunk(request.all_token_ids[start:], start, 1))
        rows = list(range(len(active)))
        for step in range(max(wanted)):
            logits = self.runner.forward_logits(chunks, [tables[i] for i in rows])
            metadata = self.target.sampling_metadata([requests[i] for i in rows], logits.shape[-1],
                                                     [step] * len(rows))
            step_probs = compute_probs(logits, metadata)
            tokens = sample_from_probs(step_probs, metadata, self.lane).tolist()
            for j, i in enumerate(rows):
                drafts[i].append(tokens[j])
                probs[i].append(step_probs[j])
            rows = [i for i in rows if len(drafts[i]) < wanted[i]]
            if not rows:
                break
            chunks = [SeqChunk([drafts[i][-1]], requests[i].num_tokens - 1 + len(drafts[i]), 1) for i in rows]

        for request, k in zip(requests, wanted):
            # K/V now holds the catch-up tokens and drafts 1..k-1.
            request.draft_num_computed_tokens = request.num_tokens + k - 1
        return DraftProposal(
            {r.request_id: d for r, d in zip(requests, drafts)},
            {r.request_id: torch.stack(p) for r, p in zip(requests, probs)},
        )

