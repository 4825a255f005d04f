"""Draft tokens from an EAGLE-3 head (:mod:`cluster.models.eagle3`) over the target's own hidden states.

Head entry ``q`` (a slot of the head's own one-layer paged KV cache, read through the
target's block tables like a draft model's) is computed from the target's fused aux states
at position ``q`` and the token at ``q + 1``. The target leaves its aux states of every token
it computed in the step's result; :meth:`Eagle3Proposer.record` keeps them per request
(fused to the head's width) until the head has read them. A request with ``n`` tokens has
target states up to position ``n - 2`` (the last token is the one the step sampled), so a
proposal first catches the head up on entries ``draft_num_computed_tokens .. n - 2`` (the
whole prompt the first time), whose last one predicts the token at ``n``, then runs one
batched pass per further draft token on its own outputs. Only entries built from target
states count as computed (``draft_num_computed_tokens = n - 1`` afterwards): the entries of
the drafts are overwritten once the target has verified them.

Drafts stay on the device from pass to pass (each pass's input tokens are the previous pass's
choices) and are read to the host once per proposal. The passes take the target's attention
path: on the flex path they are padded to the target's buckets, and where the target replays
CUDA graphs the head replays its own (:mod:`cluster.spec_decode.head_graphs`).

A prefix-cache hit leaves the head the entries of the cached blocks as the request that
filled them wrote them; where that request never drafted they are stale, which costs
acceptance, never correctness (every draft is verified). Kept states cost the head's hidden
size per token (for SmolLM2-135M a twentieth of the target's KV cache) and are dropped once
read, when a request finishes or is aborted.
"""

from __future__ import annotations

import torch

from cluster.models.eagle3 import Eagle3Head
from cluster.runner.host_copy import to_device
from cluster.runner.input_batch import SHORT_QUERY_MAX, SeqChunk, prepare_inputs
from cluster.runner.model_runner import ModelRunner
from cluster.runner.random_stream import Lane
from cluster.runner.sampler import compute_probs, sample_from_probs
from cluster.shared.draft_proposal import DraftProposal
from cluster.shared.scheduled import ScheduledRequest
from cluster.spec_decode.head_graphs import HeadGraphs


class Eagle3Proposer:
    def __init__(self, head: Eagle3Head, embed: torch.nn.Module, target: ModelRunner) -> None:
        """``head`` on the target's device and dtype; ``embed``: the target's token embedding."""
        self.head = head
        self.embed = embed
        self.target = target
        self.lane = Lane.SAMPLE if target.coupled else Lane.DRAFT
        config = head.config
        spec = target.spec
        self.block_size = spec.block_size
        self.flex = target.flex  # the head's passes take the target's attention path and buckets
        num_blocks = target.flex.num_blocks if target.flex is not None else target.num_blocks  # + scratch
        self.kv_cache = torch.zeros(2, num_blocks * spec.block_size, config.num_kv_heads, config.head_dim,
                                    dtype=spec.dtype, device=target.device)
        self.graphs = None
        if target.graphs is not None:  # the target replays its steps: so do the head's passes
            self.graphs = HeadGraphs(head, embed, self.kv_cache, target.flex, spec.block_size,
                                     target.num_blocks * spec.block_size, target.device, target.graphs.capture)
        self.states: dict[str, tuple[int, torch.Tensor]] = {}  # request -> (first position, fused [n, hidden])

    @torch.inference_mode()
    def record(self, aux_hidden: dict[str, tuple[int, torch.Tensor]]) -> None:
        """Keep a step's target states (``StepResult.aux_hidden``): a chunk starting at ``s``
        replaces what was kept from ``s`` on (drafts the target rejected, or a recomputation)."""
        if not aux_hidden:
            return
        ids = list(aux_hidden)
        fused = self.head.fuse(torch.cat([aux_hidden[r][1] for r in ids]).to(self.kv_cache.dtype))
        offset = 0
        for rid in ids:
            start, rows = aux_hidden[rid]
            new = fused[offset : offset + rows.shape[0]]
            offset += rows.shape[0]
            kept = self.states.get(rid)
            if kept is not None and kept[0] <= start <= kept[0] + kept[1].shape[0]:
                new = torch.cat([kept[1][: start - kept[0]], new])
                start = kept[0]
            self.states[rid] = (start, new)

    def free(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, scheduled: list[ScheduledRequest], block_tables: list[list[int]]) -> DraftProposal:
        active, firsts = [], []
        for s, table in zip(scheduled, block_tables):
            first = self._catch_up_start(s.request) if s.num_draft_tokens > 0 else None
            if first is not None:
                active.append((s, table))
                firsts.append(first)
        if not active:
            return DraftProposal({}, None)
        requests = [s.request for s, _ in active]
        tables = [t for _, t in active]
        wanted = [s.num_draft_tokens for s, _ in active]
        greedy = all(r.sampling_params.greedy for r in requests)

        # Pass 1: the catch-up entries; the last of each predicts the request's first draft.
        chunks, hidden = [], []
        for request, first in zip(requests, firsts):
            last = request.num_tokens - 2
            start, states = self.states[request.request_id]
            hidden.append(states[first - start : last - start + 1])
            chunks.append(SeqChunk(request.all_token_ids[first + 1 : last + 2], first, 1))
        out, logits = self.draft_pass(chunks, tables, torch.cat(hidden))
        rows = list(range(len(active)))
        chosen: list[tuple[list[int], torch.Tensor, torch.Tensor | None]] = []  # per step: rows, tokens, probs
        for step in range(max(wanted)):
            tokens, step_probs = self._choose(logits, [requests[i] for i in rows], step, greedy)
            chosen.append((rows, tokens, step_probs))
            keep = [j for j, i in enumerate(rows) if step + 1 < wanted[i]]
            if not keep:
                break
            if len(keep) < len(rows):
                index = to_device(keep, torch.int64, out.device)
                out, tokens = out.index_select(0, index), tokens.index_select(0, index)
                rows = [rows[j] for j in keep]
            # The drafts stay on the device: these chunks' token ids are placeholders for ``tokens``.
            chunks = [SeqChunk([0], requests[i].num_tokens - 2 + step, 1) for i in rows]
            out, logits = self.draft_pass(chunks, [tables[i] for i in rows], out, tokens)

        drafts: list[list[int]] = [[] for _ in active]
        probs: list[list[torch.Tensor]] = [[] for _ in active]
        flat = torch.cat([tokens for _, tokens, _ in chosen]).tolist()  # the proposal's one read of the device
        offset = 0
        for rows, _, step_probs in chosen:
            for j, i in enumerate(rows):
                drafts[i].append(flat[offset + j])
                if step_probs is not None:
                    probs[i].append(step_probs[j])
            offset += len(rows)
        for request in requests:
            request.draft_num_computed_tokens = request.num_tokens - 1
            start, states = self.states[request.request_id]  # what comes next replaces states from n - 1 on
            self.states[request.request_id] = (request.num_tokens - 1, states[request.num_tokens - 1 - start :])
        return DraftProposal(
            {r.request_id: d for r, d in zip(requests, drafts)},
            None if greedy else {r.request_id: torch.stack(p) for r, p in zip(requests, probs)},
        )

    def _choose(self, logits: torch.Tensor, requests: list, step: int,
                greedy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft ``step``'s tokens (target ids, on the device) and, when sampling, their distributions."""
        if greedy:
            return self.head.to_target_ids(logits.argmax(-1)), None
        full = logits.new_full((logits.shape[0], self.head.config.vocab_size), float("-inf"))
        full[:, self.head.to_target_ids(torch.arange(logits.shape[1], device=logits.device))] = logits
        meta = self.target.sampling_metadata(requests, full.shape[-1], [step] * len(requests))
        probs = compute_probs(full, meta)
        return sample_from_probs(probs, meta, self.lane), probs

    def _catch_up_start(self, request) -> int | None:
        """The first head entry to compute, or None when the target states it needs are not kept."""
        kept = self.states.get(request.request_id)
        last = request.num_tokens - 2
        if kept is None or last < 0:
            return None
        start, states = kept
        first = max(request.draft_num_computed_tokens, start)  # below ``start``: cached blocks' entries
        if first > last or start + states.shape[0] <= last:
            return None
        return first

    def draft_pass(self, chunks: list[SeqChunk], tables: list[list[int]], hidden: torch.Tensor,
                   input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One head pass (entries of ``chunks`` from ``hidden``, one row per token; ``input_ids``, on
        the device, in place of the chunks' token ids): its hidden states and draft-vocabulary logits
        at each chunk's last token, [num_chunks, hidden] and [num_chunks, draft_vocab]."""
        inputs = prepare_inputs(chunks, tables, self.block_size, hidden.device, SHORT_QUERY_MAX, self.flex)
        if input_ids is not None:
            inputs.input_ids = input_ids
        if self.graphs is not None and self.graphs.covers(inputs):
            out, logits = self.graphs.forward(inputs, hidden)
            return out.index_select(0, inputs.logits_indices), logits.index_select(0, inputs.logits_indices)
        embeds = self.embed(inputs.input_ids).to(hidden.dtype)
        out = self.head(embeds, hidden, inputs.positions, self.kv_cache, inputs.attn)
        out = out.index_select(0, inputs.logits_indices)
        return out, self.head.logits(out)
