"""Decode steps replayed from CUDA graphs, one per batch-size bucket (the flex path only).

A decode step (every sequence computes one token and needs its logits) of ``n`` sequences
runs as the graph of the smallest bucket ``B >= n``: its inputs are copied into the bucket's
static tensors (token ids, positions, cache slots, and the block mask's tensors, which the
captured ``mask_mod`` reads in place), the graph replays the whole model forward, and the
first ``n`` rows of its static output are the step's hidden states. The ``B - n`` padding
rows hold no blocks (their attention output is zero) and write their K/V into a scratch
block that no sequence owns, so they change nothing anyone reads.

With LoRA adapters attached, each bucket has a second graph, captured with the adapters'
updates (``LoRABatch.static``): a decode step with adapter tokens copies each row's adapter slot
into the bucket's ``lora_slots`` too and replays that one. Its projections read every adapter
stack whole, reserved at capacity first (``LoRAState.reserve``), so adapters loaded after the
capture are in the tensors the graph reads.

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
from cluster.models.lora import LoRABatch, LoRAState
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
    lora_slots: torch.Tensor | None = None  # [B]: each row's adapter slot (0: none), with LoRA attached
    hidden: torch.Tensor | None = None  # [B, hidden_size]: the captured forward's output
    graph: object | None = None  # torch.cuda.CUDAGraph once captured
    lora_hidden: torch.Tensor | None = None  # the same, of the forward with the adapters' updates
    lora_graph: object | None = None


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: torch.Tensor, layout: FlexLayout, block_size: int,
                 scratch_slot: int, device: torch.device, capture: bool, lora: LoRAState | None = None) -> None:
        """``layout.decode_buckets``: the batch sizes to build; ``scratch_slot``: the first slot of
        a cache block outside the block manager's pool. ``capture`` needs CUDA. ``lora``: the
        adapters attached to ``model`` (their stacks are reserved here)."""
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs are captured on CUDA, not {device.type}")
        self.model, self.kv_caches, self.layout, self.lora = model, kv_caches, layout, lora
        self.scratch_slot, self.device, self.capture = scratch_slot, device, capture
        if lora is not None:
            lora.reserve()
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
    def forward(self, inputs: ModelInputs, num_seqs: int, lora_slots: torch.Tensor | None = None) -> torch.Tensor:
        """The step's hidden states, [num_seqs, hidden_size] (only where :meth:`covers`).
        ``lora_slots`` ([num_seqs] on the device): each sequence's adapter slot, for a step with
        adapter tokens (needs ``lora``)."""
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
        if lora_slots is not None:
            bucket.lora_slots[:num_seqs].copy_(lora_slots)
            bucket.lora_slots[num_seqs:].zero_()
            if bucket.lora_graph is not None:
                bucket.lora_graph.replay()
                return bucket.lora_hidden[:num_seqs]
            return self._run(bucket, with_lora=True)[:num_seqs]
        if bucket.graph is not None:
            bucket.graph.replay()
            return bucket.hidden[:num_seqs]
        return self._run(bucket)[:num_seqs]

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
        return _Bucket(zeros(rows), zeros(rows), slot_mapping, meta, kv_num_blocks, kv_indices, flex,
                       zeros(rows) if self.lora is not None else None)

    def _run(self, bucket: _Bucket, with_lora: bool = False) -> torch.Tensor:
        if not with_lora:
            return self.model(bucket.input_ids, bucket.positions, self.kv_caches, bucket.meta)
        self.lora.batch = LoRABatch.static(bucket.lora_slots)
        try:
            return self.model(bucket.input_ids, bucket.positions, self.kv_caches, bucket.meta)
        finally:
            self.lora.batch = None

    def _capture_all(self) -> None:
        """Warm up (compiling each bucket's kernels) and capture, largest bucket first, all in one
        memory pool. The static inputs hold padding only: every write goes to the scratch block."""
        pool = None
        with torch.inference_mode():
            for rows in sorted(self.buckets, reverse=True):
                bucket = self.buckets[rows]
                for with_lora in (False, True) if self.lora is not None else (False,):
                    for _ in range(2):
                        self._run(bucket, with_lora)
                    torch.cuda.synchronize(self.device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        hidden = self._run(bucket, with_lora)
                    pool = graph.pool()
                    if with_lora:
                        bucket.lora_graph, bucket.lora_hidden = graph, hidden
                    else:
                        bucket.graph, bucket.hidden = graph, hidden
        torch.cuda.synchronize(self.device)
        logger.info("captured CUDA graphs of decode steps for batch sizes %s%s", sorted(self.buckets),
                    ", each also with LoRA adapters" if self.lora is not None else "")
