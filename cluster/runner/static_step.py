"""The static inputs of one bucketed flex step: what a CUDA graph of that shape reads.

A bucket is a shape ``(rows, queries)`` of :class:`cluster.models.layers.flex_paged.FlexLayout`
(a decode step: ``queries`` 1; a verify or catch-up step: each row's tokens padded to
``queries``). :meth:`StaticStep.load` copies a step's inputs into the bucket's tensors, token
``t`` to its padded place ``query_pad_index[t]`` (row ``s``, query ``i`` at ``s * queries + i``):
token ids, positions (padding queries repeat their row's last one), cache slots (padding
writes into the scratch slot's block, which no sequence owns), and the block mask's tensors,
which the captured ``mask_mod`` reads in place. A forward over these tensors, captured once,
then computes any step of the bucket's shape; its outputs are read back at the same places.
:func:`capture_graph` and :func:`largest_first` are how the target's and a draft head's graphs
are captured.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import torch

from cluster.models.layers.attention import AttentionMetadata
from cluster.models.layers.flex_paged import FlexLayout, FlexPagedMetadata, paged_block_mask
from cluster.runner.input_batch import ModelInputs

T = TypeVar("T")


@dataclass
class StaticStep:
    rows: int
    queries: int  # per row: 1 for decode, k + 1 for verify
    input_ids: torch.Tensor  # [rows * queries]
    positions: torch.Tensor  # [rows * queries]
    slot_mapping: torch.Tensor  # [rows * queries]
    meta: AttentionMetadata  # its flex block mask reads the static tensors below
    kv_num_blocks: torch.Tensor  # [rows, 1, 1] int32
    kv_indices: torch.Tensor  # [rows, 1, 1, table_width] int32
    flex: FlexPagedMetadata
    scratch_slot: int

    @classmethod
    def build(cls, rows: int, queries: int, layout: FlexLayout, block_size: int, scratch_slot: int,
              device: torch.device) -> "StaticStep":
        """Tensors of the shape, holding padding only (every write goes to the scratch block)."""
        tokens = rows * queries

        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(*shape, dtype=dtype, device=device)

        kv_num_blocks = zeros(rows, 1, 1, dtype=torch.int32)
        kv_indices = zeros(rows, 1, 1, layout.table_width, dtype=torch.int32)
        table = torch.full((rows, layout.table_width), -1, dtype=torch.int64, device=device)
        block_position = torch.full((layout.num_blocks,), -1, dtype=torch.int64, device=device)
        query_pos = zeros(rows, queries)
        mask = paged_block_mask(kv_num_blocks, kv_indices, table, block_position, query_pos, block_size, queries,
                                layout.num_blocks)
        flex = FlexPagedMetadata(mask, torch.arange(tokens, device=device), rows, queries, table, block_position,
                                 query_pos, static_shape=True)
        slot_mapping = torch.full((tokens,), scratch_slot, dtype=torch.int64, device=device)
        meta = AttentionMetadata(slot_mapping=slot_mapping, context_slots=None, attn_mask=None, query_pad_index=None,
                                 num_seqs=rows, max_query_len=queries, flex=flex)
        return cls(rows, queries, zeros(tokens), zeros(tokens), slot_mapping, meta, kv_num_blocks, kv_indices, flex,
                   scratch_slot)

    @staticmethod
    def shape_of(inputs: ModelInputs) -> tuple[int, int] | None:
        """The bucket a step's inputs were padded to, or None when they were not (not the flex path,
        or not a bucketed shape)."""
        flex = inputs.attn.flex
        if flex is None or not flex.static_shape:
            return None
        return flex.num_rows, flex.max_query_len

    def load(self, inputs: ModelInputs) -> torch.Tensor:
        """Copy a step of this shape in; returns each token's place in the padded rows."""
        flex = inputs.attn.flex
        places = flex.query_pad_index
        self.input_ids.zero_()
        self.input_ids.index_copy_(0, places, inputs.input_ids)
        self.positions.copy_(flex.query_pos.view(-1))  # padding repeats its row's last position
        self.slot_mapping.fill_(self.scratch_slot)
        self.slot_mapping.index_copy_(0, places, inputs.attn.slot_mapping)
        mask = flex.block_mask
        self.kv_num_blocks.copy_(mask.kv_num_blocks)
        self.kv_indices.copy_(mask.kv_indices)
        self.flex.table.copy_(flex.table)
        self.flex.block_position.copy_(flex.block_position)
        self.flex.query_pos.copy_(flex.query_pos)
        return places


def largest_first(shapes: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The order to capture buckets in: most tokens first, so one pool's later graphs fit in what
    the earlier ones reserved."""
    return sorted(shapes, key=lambda s: (s[0] * s[1], s), reverse=True)


def capture_graph(run: Callable[[], T], device: torch.device, pool) -> tuple[object, T]:
    """Run ``run`` twice (compiling its kernels), then capture it as a CUDA graph in ``pool`` (None:
    a new pool, then the graph's ``pool()``); returns the graph and the outputs of the captured
    run, which every replay refreshes in place."""
    for _ in range(2):
        run()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = run()
    return graph, outputs
