"""Tensor-parallel linear layers, vocabulary-parallel embedding and LM head.

A *column-parallel* layer splits its output features: each rank computes its slice
and nothing is communicated. A fused projection (QKV, gate/up) is a list of
``output_sizes`` and each part is split separately, so a rank holds its own slice of
Q, of K and of V (whole heads: the caller picks sizes that divide). A *row-parallel*
layer splits its input features, takes the column-parallel output as is, and sums the
partial products with one all-reduce; its bias is added once, after the sum.

Every parameter carries ``tp_load(source, shard_index)``, which copies this rank's
part of a checkpoint tensor into it. ``source`` is a tensor or a lazily read
checkpoint tensor (``narrow`` reads only the slice asked for, see
:mod:`cluster.parallel.weights`), so a rank reads only its shard.

These layers subclass ``nn.Module``, not ``nn.Linear``, so ``pack_linears`` leaves them
alone; :func:`pack_parallel_linears` gives them the same oneDNN-packed matmul on the CPU
(``F.linear`` elsewhere).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from cluster.kernels.packed_linear import PackedLinear, fast_cpu_linear, float32_compute_rows, pair_compute_rows
from cluster.parallel.group import TPGroup


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) must be divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


def _copy(dst: torch.Tensor, source, dim: int, start: int, length: int) -> None:
    """Copy ``source.narrow(dim, start, length)`` into ``dst``; ValueError on a shape mismatch."""
    if tuple(source.shape[:dim]) + (length,) + tuple(source.shape[dim + 1 :]) != tuple(dst.shape) or (
        start + length > source.shape[dim]
    ):
        raise ValueError(f"a checkpoint tensor of shape {tuple(source.shape)} does not hold a shard "
                         f"of shape {tuple(dst.shape)} at offset {start} of dim {dim}")
    with torch.no_grad():
        dst.copy_(source.narrow(dim, start, length))


class ColumnParallelLinear(nn.Module):
    """y[:, this rank's columns] = x @ W_local.T (+ b_local); no communication.

    ``output_sizes`` are the full sizes of the fused parts; part ``i`` holds rows
    ``[rank * size_i / tp, (rank + 1) * size_i / tp)`` of its checkpoint tensor unless
    ``shard_ranks`` maps it to another shard (replicated KV heads: see ``kv_shard``).
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool,
        tp: TPGroup,
        num_shards: list[int] | None = None,
        shard_ranks: list[int] | None = None,
    ) -> None:
        super().__init__()
        num_shards = num_shards or [tp.world_size] * len(output_sizes)
        shard_ranks = shard_ranks or [tp.rank] * len(output_sizes)
        self.local_sizes = [divide(s, n, "a projection's output size") for s, n in zip(output_sizes, num_shards)]
        self.shard_ranks = shard_ranks
        self.in_features = in_features
        self.out_features = sum(self.local_sizes)
        self.packed: nn.Module | None = None  # set by pack_parallel_linears after loading
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features))
        self.weight.tp_load = self._load
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_features))
            self.bias.tp_load = lambda source, shard: self._load(source, shard, self.bias)

    def _load(self, source, shard: int | None, param: torch.Tensor | None = None) -> None:
        param = self.weight if param is None else param
        shard = 0 if shard is None else shard
        size = self.local_sizes[shard]
        dst = param.narrow(0, sum(self.local_sizes[:shard]), size)
        _copy(dst, source, 0, self.shard_ranks[shard] * size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out / tp]
        if self.packed is not None:
            return self.packed(x)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W[:, this rank's columns].T) + b; x_local is this rank's
    slice of the input features (the output of a column-parallel layer)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.in_local = divide(in_features, tp.world_size, "a row-parallel layer's input size")
        self.in_features, self.out_features = in_features, out_features
        self.packed: nn.Module | None = None  # set by pack_parallel_linears after loading
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local))
        self.weight.tp_load = self._load_weight
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))
            self.bias.tp_load = self._load_bias

    def _load_weight(self, source, shard: int | None) -> None:
        _copy(self.weight, source, 1, self.tp.rank * self.in_local, self.in_local)

    def _load_bias(self, source, shard: int | None) -> None:
        _copy(self.bias, source, 0, 0, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in / tp] -> [num_tokens, out]
        partial = self.packed(x) if self.packed is not None else F.linear(x, self.weight)
        out = self.tp.all_reduce(partial)
        return out if self.bias is None else out + self.bias


def pack_parallel_linears(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Give every parallel linear layer a CPU-packed copy of its shard where
    ``pack_linears`` would pack a plain layer; call after loading. A row-parallel layer's
    bias stays outside (it is added after the all-reduce). Returns the layers packed."""
    if not fast_cpu_linear(device, dtype):
        return 0
    packed = 0
    float32_from_rows = float32_compute_rows(device, dtype)
    pair_from_rows = pair_compute_rows(device, dtype)
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.packed is None:
            bias = module.bias if isinstance(module, ColumnParallelLinear) else None
            shard = SimpleNamespace(in_features=module.weight.shape[1], out_features=module.weight.shape[0],
                                    weight=module.weight, bias=bias)
            module.packed = PackedLinear(shard, float32_from_rows=float32_from_rows, pair_from_rows=pair_from_rows)
            packed += 1
    return packed


class VocabParallelEmbedding(nn.Module):
    """Rank ``r`` holds rows ``[r * per_rank, (r + 1) * per_rank)`` of the vocabulary,
    padded with zero rows up to ``per_rank * tp``; a token outside a rank's range
    looks up zeros there and the all-reduce brings every row together."""

    def __init__(self, vocab_size: int, embed_dim: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // tp.world_size)
        self.vocab_start = tp.rank * self.per_rank
        self.num_real = max(0, min(self.per_rank, vocab_size - self.vocab_start))
        self.weight = nn.Parameter(torch.empty(self.per_rank, embed_dim))
        self.weight.tp_load = self._load

    def _load(self, source, shard: int | None) -> None:
        with torch.no_grad():
            self.weight.zero_()
        if self.num_real:
            _copy(self.weight[: self.num_real], source, 0, self.vocab_start, self.num_real)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, embed_dim]
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        hidden = hidden.masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(hidden)


class ParallelLMHead(nn.Module):
    """Logits of this rank's vocabulary slice, gathered on the driver, where sampling
    happens. Tied to a :class:`VocabParallelEmbedding` when ``embedding`` is given."""

    def __init__(self, vocab_size: int, embed_dim: int, tp: TPGroup, embedding: VocabParallelEmbedding | None):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        if embedding is not None:
            self.weight = embedding.weight
        else:
            owner = VocabParallelEmbedding(vocab_size, embed_dim, tp)
            self.weight = owner.weight  # same partition and loader as the embedding

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, embed_dim] -> [n, vocab_size] on the driver; [n, 0] on the other ranks."""
        logits = self.tp.gather_last_dim(F.linear(hidden, self.weight))
        if logits is None:
            return hidden.new_empty(hidden.shape[0], 0)
        return logits[:, : self.vocab_size]


class HeadShard(NamedTuple):
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    kv_num_shards: int  # the K and V projections are cut into this many shards
    kv_shard_rank: int  # and this rank holds this one


def head_shard(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> HeadShard:
    """How attention heads split over ``tp_size`` ranks; every rank holds whole heads.

    With fewer KV heads than ranks, each KV head is replicated on ``tp_size / num_kv_heads``
    consecutive ranks (as vLLM does): rank ``r`` holds KV head ``r * num_kv_heads // tp_size``.
    Raises ValueError when the heads do not split evenly.
    """
    local_heads = divide(num_heads, tp_size, "num_attention_heads")
    if num_kv_heads >= tp_size:
        return HeadShard(local_heads, divide(num_kv_heads, tp_size, "num_key_value_heads"), tp_size, rank)
    if tp_size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size ({tp_size}) must divide num_key_value_heads ({num_kv_heads}) "
            "or be a multiple of it (KV heads are then replicated)"
        )
    return HeadShard(local_heads, 1, num_kv_heads, rank * num_kv_heads // tp_size)


# Builders the models call: plain torch layers without a group (TP=1), parallel ones with it.


def column_linear(in_features: int, output_sizes: list[int], bias: bool, tp: TPGroup | None,
                  kv: HeadShard | None = None) -> nn.Module:
    """A (fused) projection; with ``kv``, the parts are [Q, K, V] and K/V follow its split."""
    if tp is None:
        return nn.Linear(in_features, sum(output_sizes), bias=bias)
    if kv is None:
        return ColumnParallelLinear(in_features, output_sizes, bias, tp)
    num_shards = [tp.world_size, kv.kv_num_shards, kv.kv_num_shards]
    ranks = [tp.rank, kv.kv_shard_rank, kv.kv_shard_rank]
    return ColumnParallelLinear(in_features, output_sizes, bias, tp, num_shards, ranks)


def row_linear(in_features: int, out_features: int, bias: bool, tp: TPGroup | None) -> nn.Module:
    if tp is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp)


def embedding(vocab_size: int, embed_dim: int, tp: TPGroup | None) -> nn.Module:
    if tp is None:
        return nn.Embedding(vocab_size, embed_dim)
    return VocabParallelEmbedding(vocab_size, embed_dim, tp)


def lm_head(vocab_size: int, embed_dim: int, tp: TPGroup | None, tied: nn.Module | None) -> nn.Module:
    """The output projection, sharing ``tied``'s weight when given."""
    if tp is not None:
        return ParallelLMHead(vocab_size, embed_dim, tp, tied)
    head = nn.Linear(embed_dim, vocab_size, bias=False)
    if tied is not None:
        head.weight = tied.weight
    return head
