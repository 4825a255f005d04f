"""An EAGLE-3 head's draft passes replayed from CUDA graphs, one per bucket of the target's layout.

The head drafts in two kinds of pass (:mod:`cluster.spec_decode.eagle3_proposer`): a catch-up
pass over the tokens the target just verified (a few per sequence: the shape of a verify step)
and one pass per further draft token (one per sequence: a decode step's shape). Both run on the
flex path with the target's :class:`cluster.models.layers.flex_paged.FlexLayout`, so their
shapes are the target's buckets: ``(rows, 1)`` for the decode buckets up to the largest verify
bucket (drafting beyond that batch is rare, the controller drafts little there) and ``(rows,
queries)`` for every verify bucket. A pass is copied into its bucket's static tensors
(:class:`cluster.runner.static_step.StaticStep`, plus the head's input states), the graph
replays the head's layer, final norm and output layer, and the outputs read back at the tokens'
places are the pass's hidden states and draft-vocabulary logits. Padding writes its K/V into
the head cache's scratch block.

The graphs and their pool's memory are counted (``summary``). Capture needs CUDA; with
``capture=False`` the same static tensors run eagerly, which is how the CPU tests check them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from cluster.models.eagle3 import Eagle3Head
from cluster.models.layers.flex_paged import FlexLayout
from cluster.runner.input_batch import ModelInputs
from cluster.runner.static_step import StaticStep, capture_graph, largest_first

logger = logging.getLogger(__name__)


@dataclass
class _Bucket:
    step: StaticStep
    hidden_in: torch.Tensor  # [rows * queries, hidden]: fused target states or the head's previous outputs
    out: torch.Tensor | None = None  # the captured pass's hidden states
    logits: torch.Tensor | None = None  # ... and its draft-vocabulary logits (float32)
    graph: object | None = None  # torch.cuda.CUDAGraph once captured


def head_shapes(layout: FlexLayout) -> list[tuple[int, int]]:
    """The buckets a head's passes replay: one-token passes up to the largest verify bucket, and
    every verify shape (none without verify buckets)."""
    if not layout.verify_buckets:
        return []
    widest = max(layout.verify_buckets)
    shapes = [(rows, 1) for rows in layout.decode_buckets if rows <= widest]
    return shapes + [(rows, q) for rows in layout.verify_buckets for q in layout.query_buckets]


class HeadGraphs:
    def __init__(self, head: Eagle3Head, embed: torch.nn.Module, kv_cache: torch.Tensor, layout: FlexLayout,
                 block_size: int, scratch_slot: int, device: torch.device, capture: bool) -> None:
        """``kv_cache``: the head's, over ``layout.num_blocks`` blocks; ``scratch_slot``: the first
        slot of the block outside the block manager's pool. ``capture`` needs CUDA."""
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs are captured on CUDA, not {device.type}")
        self.head, self.embed, self.kv_cache, self.device = head, embed, kv_cache, device
        hidden, dtype = head.config.hidden_size, kv_cache.dtype
        self.buckets = {
            (rows, q): _Bucket(StaticStep.build(rows, q, layout, block_size, scratch_slot, device),
                               torch.zeros(rows * q, hidden, dtype=dtype, device=device))
            for rows, q in head_shapes(layout)
        }
        self.pool_bytes = 0
        self.passes = {"catch_up": 0, "draft": 0}  # passes run through a bucket (replayed, or the dry run)
        if capture:
            self._capture_all()

    @property
    def summary(self) -> dict:
        return {"graphs": sum(b.graph is not None for b in self.buckets.values()), "shapes": len(self.buckets),
                "pool_mib": round(self.pool_bytes / 2**20, 1), "passes": dict(self.passes)}

    def covers(self, inputs: ModelInputs) -> bool:
        return StaticStep.shape_of(inputs) in self.buckets

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A covered pass (``hidden``: [num_tokens, hidden], one row per token): its hidden states
        and logits, in the pass's token order."""
        bucket = self.buckets[StaticStep.shape_of(inputs)]
        self.passes["catch_up" if bucket.step.queries > 1 else "draft"] += 1
        places = bucket.step.load(inputs)
        bucket.hidden_in.zero_()
        bucket.hidden_in.index_copy_(0, places, hidden)
        if bucket.graph is not None:
            bucket.graph.replay()
            out, logits = bucket.out, bucket.logits
        else:
            out, logits = self._run(bucket)
        return out.index_select(0, places), logits.index_select(0, places)

    def _run(self, bucket: _Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        step = bucket.step
        embeds = self.embed(step.input_ids).to(bucket.hidden_in.dtype)
        out = self.head(embeds, bucket.hidden_in, step.positions, self.kv_cache, step.meta)
        return out, self.head.logits(out)

    def _capture_all(self) -> None:
        """Capture every bucket, biggest first, in one memory pool."""
        pool = None
        torch.cuda.synchronize(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        with torch.inference_mode():
            for shape in largest_first(self.buckets):
                bucket = self.buckets[shape]
                bucket.graph, (bucket.out, bucket.logits) = capture_graph(lambda: self._run(bucket), self.device,
                                                                          pool)
                pool = bucket.graph.pool()
        torch.cuda.synchronize(self.device)
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - reserved
        logger.info("captured %d CUDA graphs of the draft head in %.1f MiB", len(self.buckets),
                    self.pool_bytes / 2**20)
