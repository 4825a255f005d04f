"""Decode steps replayed from CUDA graphs, one per batch-size bucket (the flex path only).

A decode step (every sequence computes one token and needs its logits) of ``n`` sequences
runs as the graph of the smallest bucket ``B >= n``: its inputs are copied into the bucket's
static tensors (token ids, positions, cache slots, and the block mask's tensors, which the
captured ``mask_mod`` reads in place), the graph replays the whole model forward, and the
first ``n`` rows of its static output are the step's hidden states. The ``B - n`` padding
rows hold no blocks (their attention output is zero) and write their K/V into a scratch
block that no sequence owns, so they change nothing anyone reads.

Capture needs CUDA; :class:`DecodeGraphs` with ``capture=False`` runs the same static
tensors through the model eagerly, which is how the CPU tests check the padding and the
static copies (a captured graph replays exactly those kernels on those tensors).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from cluster.models.layers.attention import AttentionMetadata
from cluster.models.layers.flex_paged import FlexLayout, FlexPagedMetadata, paged_block_mask
from cluster.runner.input_batch import ModelInputs

logger = logging.getLogger(__name__)

DECODE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The buckets up to ``max_num_seqs`` (which is one, so every decode step has a graph)."""
    return tuple(sorted({b for b in DECODE_BUCKETS if b < max_num_seqs} | {max_num_seqs}))


@dataclass
class _Bucket:
    input_ids: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    slot_mapping: torch.Tensor  # [B]
    meta: AttentionMetadata  # its flex block mask reads the static tensors below
    kv_num_blocks: torch.Tensor  # [B, 1, 1] int32
    kv_indices: torch.Tensor  # [B, 1, 1, table_width] int32
    flex: FlexPagedMetadata
    hidden: torch.Tensor | None = None  # [B, hidden_size]: the captured forward's output
    graph: object | None = None  # torch.cuda.CUDAGraph once captured


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: torch.Tensor, layout: FlexLayout, block_size: int,
                 scratch_slot: int, device: torch.device, capture: bool) -> None:
        """``layout.decode_buckets``: the batch sizes to build; ``scratch_slot``: the first slot of
        a cache block outside the block manager's pool. ``capture`` needs CUDA."""
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs are captured on CUDA, not {device.type}")
        self.model, self.kv_caches, self.layout = model, kv_caches, layout
        self.scratch_slot, self.device, self.capture = scratch_slot, device, capture
        self.buckets = {b: self._static(b, block_size) for b in layout.decode_buckets}
        self.max_rows = max(self.buckets)
        if capture:
            self._capture_all()

    def covers(self, inputs: ModelInputs, num_seqs: int) -> bool:
        """Whether this step replays a graph: a bucketed decode step on the flex path."""
        flex = inputs.attn.flex
        return (flex is not None and flex.static_shape and num_seqs <= self.max_rows
                and inputs.logits_indices.numel() == num_seqs)

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs, num_seqs: int) -> torch.Tensor:
        """The step's hidden states, [num_seqs, hidden_size] (only where :meth:`covers`)."""
        flex = inputs.attn.flex
        bucket = self.buckets[flex.num_rows]
        bucket.input_ids[:num_seqs].copy_(inputs.input_ids)
        bucket.positions[:num_seqs].copy_(inputs.positions)
        bucket.slot_mapping[:num_seqs].copy_(inputs.attn.slot_mapping)
        bucket.positions[num_seqs:].zero_()
        bucket.slot_mapping[num_seqs:].fill_(self.scratch_slot)
        mask = flex.block_mask
        bucket.kv_num_blocks.copy_(mask.kv_num_blocks)
        bucket.kv_indices.copy_(mask.kv_indices)
        bucket.flex.table.copy_(flex.table)
        bucket.flex.block_position.copy_(flex.block_position)
        bucket.flex.query_pos.copy_(flex.query_pos)
        if bucket.graph is not None:
            bucket.graph.replay()
            hidden = bucket.hidden
        else:
            hidden = self._run(bucket)
        return hidden[:num_seqs]

    def _static(self, rows: int, block_size: int) -> _Bucket:
        layout, device = self.layout, self.device

        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(*shape, dtype=dtype, device=device)

        kv_num_blocks, kv_indices = zeros(rows, 1, 1, dtype=torch.int32), zeros(rows, 1, 1, layout.table_width,
                                                                               dtype=torch.int32)
        table = torch.full((rows, layout.table_width), -1, dtype=torch.int64, device=device)
        block_position = torch.full((layout.num_blocks,), -1, dtype=torch.int64, device=device)
        query_pos = zeros(rows, 1)
        mask = paged_block_mask(kv_num_blocks, kv_indices, table, block_position, query_pos, block_size, 1,
                                layout.num_blocks)
        flex = FlexPagedMetadata(mask, torch.arange(rows, device=device), rows, 1, table, block_position, query_pos,
                                 static_shape=True)
        slot_mapping = torch.full((rows,), self.scratch_slot, dtype=torch.int64, device=device)
        meta = AttentionMetadata(slot_mapping=slot_mapping, context_slots=None, attn_mask=None, query_pad_index=None,
                                 num_seqs=rows, max_query_len=1, flex=flex)
        return _Bucket(zeros(rows), zeros(rows), slot_mapping, meta, kv_num_blocks, kv_indices, flex)

    def _run(self, bucket: _Bucket) -> torch.Tensor:
        return self.model(bucket.input_ids, bucket.positions, self.kv_caches, bucket.meta)

    def _capture_all(self) -> None:
        """Warm up (compiling each bucket's kernels) and capture, largest bucket first, all in one
        memory pool. The static inputs hold padding only: every write goes to the scratch block."""
        pool = None
        with torch.inference_mode():
            for rows in sorted(self.buckets, reverse=True):
                bucket = self.buckets[rows]
                for _ in range(2):
                    self._run(bucket)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    bucket.hidden = self._run(bucket)
                bucket.graph, pool = graph, graph.pool()
        torch.cuda.synchronize(self.device)
        logger.info("captured CUDA graphs of decode steps for batch sizes %s", sorted(self.buckets))
