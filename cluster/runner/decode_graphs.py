"""Decode and verify steps replayed from CUDA graphs, one per bucket (the flex path only).

A bucket is a shape ``(rows, queries)``: a decode step (every sequence computes one token) of
``n`` sequences runs as the graph of the smallest decode bucket ``(B >= n, 1)``; a verify step
(each sequence's last token and its drafts, up to ``k + 1`` queries, every one's logits needed)
of at most ``max(verify_buckets)`` sequences as that of ``(B >= n, Q >= the longest)``. The
step is copied into the bucket's static tensors (:class:`cluster.runner.static_step.StaticStep`,
padding into a scratch block), the graph replays the whole model forward, and the static
output read back at the tokens' places is the step's hidden states. With a draft head attached
(``model.aux_layer_ids``) the graph's outputs include the aux states the head reads, read back
the same way into ``model.aux_hidden``.

With LoRA adapters attached, each bucket has a second graph, captured with the adapters'
updates (``LoRABatch.static``): a step with adapter tokens copies each token's adapter slot
into the bucket's ``lora_slots`` too and replays that one. Its projections read every adapter
stack whole, reserved at capacity first (``LoRAState.reserve``), so adapters loaded after the
capture are in the tensors the graph reads.

The graphs, and the memory their pool took, are counted at capture (``summary``); the buckets
are few by construction (``decode_buckets``, ``verify_buckets``, ``query_buckets``).

Capture needs CUDA; :class:`DecodeGraphs` with ``capture=False`` runs the same static
tensors through the model eagerly, which is how the CPU tests check the padding and the
static copies (a captured graph replays exactly those kernels on those tensors).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from cluster.models.layers.flex_paged import FlexLayout
from cluster.models.lora import LoRABatch, LoRAState
from cluster.runner.input_batch import ModelInputs
from cluster.runner.static_step import StaticStep, capture_graph, largest_first

logger = logging.getLogger(__name__)

DECODE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
VERIFY_MAX_ROWS = 32  # verify steps of more sequences run eagerly (the controller drafts little there)


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The buckets up to ``max_num_seqs`` (which is one, so every decode step has a graph)."""
    return tuple(sorted({b for b in DECODE_BUCKETS if b < max_num_seqs} | {max_num_seqs}))


def verify_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The sequence counts verify steps are padded to: the decode buckets up to VERIFY_MAX_ROWS."""
    return tuple(b for b in decode_buckets(min(max_num_seqs, VERIFY_MAX_ROWS)))


def query_buckets(max_k: int) -> tuple[int, ...]:
    """The queries per sequence verify steps are padded to: k + 1 for k = 1, 2, 4, 8, ... below
    ``max_k``, and ``max_k + 1`` (none without speculation)."""
    if max_k < 1:
        return ()
    return tuple(sorted({k + 1 for k in (1, 2, 4, 8, 16) if k < max_k} | {max_k + 1}))


@dataclass
class _Bucket:
    step: StaticStep
    lora_slots: torch.Tensor | None = None  # [rows * queries]: each token's adapter slot (0: none), with LoRA
    hidden: torch.Tensor | None = None  # [rows * queries, hidden_size]: the captured forward's output
    aux: torch.Tensor | None = None  # [rows * queries, aux width]: the captured aux states, with a draft head
    graph: object | None = None  # torch.cuda.CUDAGraph once captured
    lora_hidden: torch.Tensor | None = None  # the same three, of the forward with the adapters' updates
    lora_aux: torch.Tensor | None = None
    lora_graph: object | None = None


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: torch.Tensor, layout: FlexLayout, block_size: int,
                 scratch_slot: int, device: torch.device, capture: bool, lora: LoRAState | None = None) -> None:
        """``layout``: the buckets to build (``decode_buckets``, and ``verify_buckets`` x
        ``query_buckets``); ``scratch_slot``: the first slot of a cache block outside the block
        manager's pool. ``capture`` needs CUDA. ``lora``: the adapters attached to ``model``
        (their stacks are reserved here)."""
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs are captured on CUDA, not {device.type}")
        self.model, self.kv_caches, self.layout, self.lora = model, kv_caches, layout, lora
        self.scratch_slot, self.device, self.capture = scratch_slot, device, capture
        if lora is not None:
            lora.reserve()
        shapes = [(rows, 1) for rows in layout.decode_buckets]
        shapes += [(rows, q) for rows in layout.verify_buckets for q in layout.query_buckets]
        self.buckets = {shape: self._bucket(*shape, block_size) for shape in shapes}
        self.pool_bytes = 0
        self.steps = {"decode": 0, "verify": 0}  # steps run through a bucket (replayed, or the dry run)
        if capture:
            self._capture_all()

    @property
    def summary(self) -> dict:
        """What was built: graphs, their shapes and the memory their pool reserved (0 in a dry run)."""
        graphs = sum((b.graph is not None) + (b.lora_graph is not None) for b in self.buckets.values())
        return {"graphs": graphs, "decode_batch_sizes": list(self.layout.decode_buckets),
                "verify_batch_sizes": list(self.layout.verify_buckets),
                "verify_queries": list(self.layout.query_buckets), "with_lora": self.lora is not None,
                "pool_mib": round(self.pool_bytes / 2**20, 1), "steps": dict(self.steps)}

    def covers(self, inputs: ModelInputs) -> bool:
        """Whether this step replays a graph: a bucketed decode or verify step on the flex path."""
        return StaticStep.shape_of(inputs) in self.buckets

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs, token_slots: torch.Tensor | None = None) -> torch.Tensor:
        """The step's hidden states, [num_tokens, hidden_size] in the step's token order (only where
        :meth:`covers`); with a draft head, ``model.aux_hidden`` the same way. ``token_slots``
        ([num_tokens] on the device): each token's adapter slot, for a step with adapter tokens
        (needs ``lora``)."""
        bucket = self.buckets[StaticStep.shape_of(inputs)]
        self.steps["verify" if bucket.step.queries > 1 else "decode"] += 1
        places = bucket.step.load(inputs)
        with_lora = token_slots is not None
        if with_lora:
            bucket.lora_slots.zero_()
            bucket.lora_slots.index_copy_(0, places, token_slots)
        graph = bucket.lora_graph if with_lora else bucket.graph
        if graph is not None:
            graph.replay()
            hidden, aux = (bucket.lora_hidden, bucket.lora_aux) if with_lora else (bucket.hidden, bucket.aux)
        else:
            hidden = self._run(bucket, with_lora)
            aux = getattr(self.model, "aux_hidden", None)
        if aux is not None:
            self.model.aux_hidden = aux.index_select(0, places)
        return hidden.index_select(0, places)

    def _bucket(self, rows: int, queries: int, block_size: int) -> _Bucket:
        step = StaticStep.build(rows, queries, self.layout, block_size, self.scratch_slot, self.device)
        lora_slots = torch.zeros(rows * queries, dtype=torch.int64, device=self.device) if self.lora is not None else None
        return _Bucket(step, lora_slots)

    def _run(self, bucket: _Bucket, with_lora: bool = False) -> torch.Tensor:
        if not with_lora:
            return self.model(bucket.step.input_ids, bucket.step.positions, self.kv_caches, bucket.step.meta)
        self.lora.batch = LoRABatch.static(bucket.lora_slots)
        try:
            return self.model(bucket.step.input_ids, bucket.step.positions, self.kv_caches, bucket.step.meta)
        finally:
            self.lora.batch = None

    def _capture_all(self) -> None:
        """Warm up (compiling each bucket's kernels) and capture, biggest bucket first, all in one
        memory pool. The static inputs hold padding only: every write goes to the scratch block."""
        pool = None
        torch.cuda.synchronize(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        with torch.inference_mode():
            for shape in largest_first(self.buckets):
                bucket = self.buckets[shape]
                for with_lora in (False, True) if self.lora is not None else (False,):
                    graph, hidden = capture_graph(lambda: self._run(bucket, with_lora), self.device, pool)
                    pool = graph.pool()
                    aux = getattr(self.model, "aux_hidden", None)
                    if with_lora:
                        bucket.lora_graph, bucket.lora_hidden, bucket.lora_aux = graph, hidden, aux
                    else:
                        bucket.graph, bucket.hidden, bucket.aux = graph, hidden, aux
        torch.cuda.synchronize(self.device)
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - reserved
        summary = self.summary
        logger.info("captured %d CUDA graphs in %.1f MiB: decode steps of %s sequences, verify steps of %s "
                    "sequences x %s queries%s", summary["graphs"], summary["pool_mib"],
                    summary["decode_batch_sizes"], summary["verify_batch_sizes"], summary["verify_queries"],
                    ", each also with LoRA adapters" if self.lora is not None else "")
