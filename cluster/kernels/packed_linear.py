"""Linear layers with weights pre-packed for the CPU: our few-row kernel and oneDNN.

Up to ``SMALL_GEMM_MAX_ROWS[dtype]`` rows (decode steps, draft verification) a layer runs
:mod:`cluster.kernels` ``small_gemm``, which reads a tile-packed copy of the weight as one
sequential stream per thread and reuses it for every row. On a 2-core AVX-512 CPU reading
memory at 42 GB/s, all linear layers of a SmolLM2-135M step (distinct weights, as in a
forward pass) took, in ms at 1 / 2 / 4 / 8 / 16 rows:
float32: small_gemm 14.0 / 12.6 / 14.0 / 20.3 / 29.6, oneDNN-packed 35.3 / 15.6 / 15.4 / 18.1 / 24.5,
``F.linear`` 34.4 / 56.6 / 53.1 / 49.2 / 61.2;
bfloat16: small_gemm 6.9 / 8.5 / 8.4 / 10.0 / 17.7, oneDNN-packed 9.4 / 10.4 / 10.4 / 10.4 / 12.8.
Above those rows (prefill, large batches) oneDNN's packed weight wins, as below, except where
the CPU's bfloat16 pair product is fast (AVX-512-BF16 without AMX, probed:
:mod:`cluster.kernels.pair_products`): there ``pair_gemm``'s copy takes oneDNN's place.

``F.linear`` on the CPU hands oneDNN a plain row-major weight and lets it reorder the
weight into its blocked layout on every call. Reordering once at load time and calling
oneDNN's linear directly saves that work: on SmolLM2's shapes in bfloat16 (AMX) all
linear layers of a decode step took 32-43 ms for 1-32 rows instead of 40-46 ms, and
whole-engine decoding ran 10-18% faster at batch 1, 8 and 32 (2-core CPU, A/B in one
process). bfloat16 results are bit-identical to ``F.linear``.

float32 loses at 1 row and gains from 2 rows on: on an AVX-512/AMX CPU +35% at 8 rows,
+25% at 32, -15% at 1; on a 2-core AVX2 CPU, SmolLM2's four layer shapes together took
437 / 425 / 470 us packed against 768 / 1074 / 990 us with ``F.linear`` at 2 / 3 / 4 rows
(``F.linear`` is slow at 2-4 rows there, exactly the rows that verify 1-3 draft tokens) and
476 against 430 us at 1 row. So float32 layers keep the plain weight too and take it below
``_FLOAT32_MIN_PACKED_ROWS`` rows; that doubles their weight memory, acceptable for the
small float32 models CPUs serve.

With ``batch_invariant`` (``model.batch_invariant``) small_gemm takes every row count, in
calls of at most its ``max_rows``: a token's output then never depends on how many other
rows share the call (prefill runs slower than through oneDNN). Such a layer holds only
small_gemm's copy of its weight.

A layer thus holds two copies of its weight on the CPU (small_gemm's and oneDNN's, or
small_gemm's and the plain one where oneDNN cannot pack the dtype). A bfloat16 layer holds a
third, packed for ``widening_gemm`` (float32 arithmetic on the bfloat16 weight), on a CPU that
computes float32 faster from some row count on (:mod:`cluster.kernels.float32_gemm`); rows
from there on take it. On other devices,
other dtypes, or where neither path exists, ``pack_linears`` leaves the model untouched,
so the model code is the same everywhere.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from cluster.kernels.build import pair_gemm, small_gemm, widening_gemm
from cluster.kernels.float32_gemm import float32_gemm_min_rows
from cluster.kernels.pair_products import pair_gemm_takes_few_rows, pair_gemm_wins
from cluster.kernels.small_rows import SMALL_GEMM_MAX_ROWS, small_gemm_max_rows

logger = logging.getLogger(__name__)

# oneDNN picks its blocked layout for this many rows; packed weights serve any row count.
_PACK_ROWS_HINT = 32
_PACKED_DTYPES = (torch.bfloat16, torch.float32)
_FLOAT32_MIN_PACKED_ROWS = 2
# SMALL_GEMM_MAX_ROWS (cluster.kernels.small_rows): the fewest rows small_gemm takes. It computes
# each row the same way whatever the row count, so a batch-1 verification of up to 8 (bfloat16)
# or 7 (float32) draft tokens gets bit for bit the logits of plain decoding (speculation keeps
# greedy output identical). What exactness cost there, all linear layers of a step at 8 / 9 rows
# against oneDNN (2-core AVX-512): bfloat16 6.74 / 6.93 ms against 6.54 / 6.85 (+3% / +1%);
# float32 13.8 / 14.6 against 11.7 / 11.7 (+18% / +24%, so float32 stops at 8 rows). With 8 rows
# in bfloat16, k = 8 at batch 1 kept plain decoding's greedy text for 2 of 32 requests. bfloat16
# layers take more where the probe finds small_gemm no slower (small_gemm_max_rows), and none where
# pair_gemm, which computes rows alike too, is faster at every row (pair_products).
_ANY_ROWS = 1 << 62  # small_max_rows of a batch-invariant layer


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` through small_gemm for few rows, oneDNN's packed weight for
    more, and ``F.linear`` on the plain weight where neither applies. ``batch_invariant``:
    small_gemm for every row count (ValueError where it cannot take the weight).
    ``float32_from_rows``: a bfloat16 layer computes calls of that many rows or more in
    float32 arithmetic, through ``widening_gemm`` on its own copy of the weight (None: never).
    ``small_max_rows``: the most rows small_gemm takes (default ``SMALL_GEMM_MAX_ROWS``).
    ``pair_from_rows``: a bfloat16 layer computes calls of that many rows or more through
    ``pair_gemm`` (:mod:`cluster.kernels.pair_products`), packed for it instead of for oneDNN; 1:
    every call, and no small_gemm copy; above 1, small_gemm keeps the rows it takes (None: never)."""

    def __init__(self, linear: nn.Linear, batch_invariant: bool = False, float32_from_rows: int | None = None,
                 small_max_rows: int | None = None, pair_from_rows: int | None = None) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self._pair = (pair_gemm() if pair_from_rows is not None and not batch_invariant and float32_from_rows is None
                      and weight.device.type == "cpu" and weight.dtype == torch.bfloat16
                      and self.in_features % 2 == 0 else None)
        pair_takes_all = self._pair is not None and pair_from_rows <= 1
        self._kernel = None if pair_takes_all else small_gemm_for(weight)
        if batch_invariant and self._kernel is None:
            raise ValueError(f"model.batch_invariant needs the compiled small_gemm kernel for a "
                             f"{weight.dtype} [{self.out_features}, {self.in_features}] weight on "
                             f"{weight.device.type}: it takes CPU float32/bfloat16 weights whose in_features "
                             f"is a multiple of {64 // weight.element_size()}")
        # batch_invariant: every row count through small_gemm (in calls of its max_rows at most)
        self._rows_per_call = self._kernel.max_rows if self._kernel is not None else 0
        self.small_max_rows = (0 if self._kernel is None else _ANY_ROWS if batch_invariant else
                               min(small_max_rows or SMALL_GEMM_MAX_ROWS[weight.dtype], self._kernel.max_rows))
        small = self._kernel.pack(weight.contiguous()) if self._kernel is not None else None
        self.register_buffer("small_gemm_weight", small)
        # The kernel adds a float32 bias; converted once here, not on every call.
        small_bias = self.bias.float() if small is not None and self.bias is not None else None
        self.register_buffer("small_gemm_bias", small_bias)
        self.pair_from_rows = self.small_max_rows + 1 if self._pair is not None else None  # every row small_gemm leaves
        self.register_buffer("pair_weight", self._pair.pack(weight.contiguous()) if self._pair is not None else None)
        self.register_buffer("pair_bias", self.bias.float() if self._pair is not None and self.bias is not None
                             else None)
        onednn = None
        # batch_invariant: small_gemm takes every row; pair_from_rows: pair_gemm takes the rest
        if can_pack(weight.device, weight.dtype) and not batch_invariant and self._pair is None:
            onednn = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS_HINT)
        self.register_buffer("packed_weight", onednn)
        # oneDNN's float32 path loses at 1 row: keep the plain weight for rows small_gemm does not take.
        self.min_packed_rows = _FLOAT32_MIN_PACKED_ROWS if weight.dtype == torch.float32 else 0
        needs_plain = not batch_invariant and self._pair is None and (
            self.packed_weight is None or self.min_packed_rows > max(self.small_max_rows, 1))
        self.plain_weight = weight if needs_plain else None
        self._widening = widening_gemm() if float32_from_rows is not None and weight.dtype == torch.bfloat16 else None
        wide = self._widening is not None and onednn is not None
        self.float32_from_rows = max(float32_from_rows, self.small_max_rows + 1) if wide else None
        self.register_buffer("widened_weight", self._widening.pack(weight.contiguous()) if wide else None)
        self.register_buffer("float32_bias", self.bias.float() if wide and self.bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out]
        rows = x.shape[0]
        if 0 < rows <= self.small_max_rows:
            return self._small_gemm(x)
        if self.float32_from_rows is not None and rows >= self.float32_from_rows:
            return self._widening.linear(x, self.widened_weight, self.out_features, self.float32_bias)
        if self.pair_from_rows is not None:
            return self._pair.linear(x, self.pair_weight, self.out_features, self.pair_bias)
        if self.packed_weight is not None and rows >= self.min_packed_rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.plain_weight, self.bias)

    def _small_gemm(self, x: torch.Tensor) -> torch.Tensor:
        step = self._rows_per_call
        if x.shape[0] > step:  # batch-invariant mode only: each row is computed alike in every call
            return torch.cat([self._small_gemm(x[i:i + step]) for i in range(0, x.shape[0], step)])
        return self._kernel.linear(x.contiguous(), self.small_gemm_weight, self.out_features, self.small_gemm_bias)


def small_gemm_for(weight: torch.Tensor):
    """The compiled small_gemm kernel if it takes this weight (CPU, float32 or bfloat16,
    in_features a multiple of a cache line's elements), else None."""
    if weight.device.type != "cpu" or weight.dtype not in SMALL_GEMM_MAX_ROWS:
        return None
    if weight.shape[1] % (64 // weight.element_size()):
        return None
    return small_gemm()


def fast_cpu_linear(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :class:`PackedLinear` has a faster path than ``F.linear`` here."""
    if device.type != "cpu" or dtype not in _PACKED_DTYPES:
        return False
    return can_pack(device, dtype) or (dtype in SMALL_GEMM_MAX_ROWS and small_gemm() is not None)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype in _PACKED_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and onednn_packs(dtype)
    )


def pair_compute_rows(device: torch.device, dtype: torch.dtype, batch_invariant: bool = False) -> int | None:
    """From how many rows ``dtype`` layers on ``device`` compute on the bfloat16 pair product:
    bfloat16 CPU layers, not batch-invariant, where the probes chose it (:func:`pair_gemm_wins`), from
    1 row where it is no slower than small_gemm either (:func:`pair_gemm_takes_few_rows`), else from
    the rows small_gemm leaves; None everywhere else."""
    if not (dtype == torch.bfloat16 and not batch_invariant and can_pack(device, dtype)
            and float32_compute_rows(device, dtype) is None and pair_gemm_wins()):
        return None
    return 1 if pair_gemm_takes_few_rows() else SMALL_GEMM_MAX_ROWS[dtype] + 1


def float32_compute_rows(device: torch.device, dtype: torch.dtype, batch_invariant: bool = False) -> int | None:
    """From how many rows ``dtype`` layers on ``device`` compute in float32: bfloat16 layers on
    a CPU where float32 arithmetic on the widened weights beats oneDNN's bfloat16 GEMM
    (:func:`float32_gemm_min_rows`); None everywhere else, and with ``batch_invariant``
    (small_gemm takes every row then)."""
    if dtype != torch.bfloat16 or batch_invariant or not can_pack(device, dtype):
        return None
    return float32_gemm_min_rows()


@functools.lru_cache(maxsize=None)
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN packs and runs ``dtype`` weights: its bfloat16 path
    needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT and raises on a plain AVX2 CPU, where
    the model then keeps ``F.linear``. Probed once per dtype on a tiny layer."""
    try:
        weight = torch.ones(8, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS_HINT)
        torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=dtype), packed, None, "none", [], "")
    except RuntimeError as err:
        logger.info("oneDNN cannot pack %s linear weights on this CPU (%s); using F.linear", dtype, err)
        return False
    return True


def pack_linears(model: nn.Module, device: torch.device, dtype: torch.dtype, batch_invariant: bool = False) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`PackedLinear` where it pays
    (with ``batch_invariant``: everywhere, through small_gemm, or ValueError).

    Call after the weights are loaded. A head tied to the embedding keeps the embedding
    and gets a packed copy. bfloat16 layers compute in float32 arithmetic from the row count where
    this CPU does that faster (:func:`float32_compute_rows`), if it has one, else on the pair
    product where that is faster than oneDNN (:func:`pair_compute_rows`; every row where it beats
    small_gemm too), and up to the rows where small_gemm is no slower than the kernel after it
    (:func:`small_gemm_max_rows`) they take small_gemm. Returns the number of layers replaced.
    """
    if batch_invariant and (device.type != "cpu" or dtype not in SMALL_GEMM_MAX_ROWS or small_gemm() is None):
        raise ValueError(f"model.batch_invariant runs on the CPU in float32 or bfloat16 with the compiled kernels "
                         f"of cluster/kernels; got {device.type} {dtype}"
                         + ("" if device.type != "cpu" or dtype not in SMALL_GEMM_MAX_ROWS
                            else " (the small_gemm kernel did not build here: see the log)"))
    if not fast_cpu_linear(device, dtype):
        return 0
    float32_from_rows = float32_compute_rows(device, dtype, batch_invariant)
    pair_from_rows = pair_compute_rows(device, dtype, batch_invariant)
    small_rows = (small_gemm_max_rows(dtype) if dtype in SMALL_GEMM_MAX_ROWS and small_gemm() is not None
                  and can_pack(device, dtype) and pair_from_rows != 1 else None)
    replaced = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                layer = PackedLinear(child, batch_invariant, float32_from_rows, small_rows, pair_from_rows)
                setattr(module, child_name, layer)
                replaced += 1
    logger.info("packed %d linear layers for the CPU", replaced)
    return replaced
