"""The LoRA updates of one part of a projection, stacked: what ``LoRALinear`` multiplies by.

A part (its output columns ``[offset, end)`` of a fused projection) holds the A of every adapter
that targets it in ``a`` ([rows, in]) and their B transposed in ``bt`` ([rows, size]; rows of
one contiguous block are a faster right-hand side than columns of B), in slot order, packed from
row 0: an adapter of rank r takes r rows, and ``column_slots`` says whose each row is (-1: none).

``capacity`` is the most rows the part may ever hold (the ranks of the adapters loaded at start,
plus ``max_lora_rank`` for every adapter ``lora_dir`` may add). The tensors grow as adapters come
until :meth:`PartStack.reserve` allocates them at capacity once; from then on adding and removing
adapters write into the same tensors, so a CUDA graph captured over them replays every adapter
loaded later (``LoRALinear.reserve`` puts the A and row slots of a projection's parts in one
tensor each, so the graph multiplies them at once). Once reserved, rows past the last adapter
are zero and belong to no slot, so a product over every row is exact.
"""

from __future__ import annotations

import torch


class PartStack:
    def __init__(self, offset: int, size: int, in_features: int, capacity: int) -> None:
        self.offset, self.end, self.in_features, self.capacity = offset, offset + size, in_features, capacity
        self.columns: dict[int, tuple[int, int]] = {}  # slot -> its rows [start, end) of a and bt
        self.used = 0  # rows [0, used) hold adapters
        self.reserved = False
        self.a: torch.Tensor | None = None
        self.bt: torch.Tensor | None = None
        self.column_slots: torch.Tensor | None = None

    def add(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Stack ``slot``'s A [r, in] and B [size, r] after the adapters already here."""
        rank = a.shape[0]
        if self.used + rank > self.capacity:
            raise ValueError(f"LoRA slot {slot} needs {rank} rows; {self.capacity - self.used} of "
                             f"{self.capacity} are free")
        if self.a is None or self.used + rank > self.a.shape[0]:
            self._allocate(self.used + rank, a.device, a.dtype)
        start, end = self.used, self.used + rank
        self.a[start:end].copy_(a)
        self.bt[start:end].copy_(b.t())
        self.column_slots[start:end].fill_(slot)
        self.columns[slot] = (start, end)
        self.used = end

    def remove(self, slot: int) -> None:
        """Drop ``slot``'s rows; the adapters after it move up. Reserved, the freed rows become zero
        and no one's (a product over every row reads them); else nothing reads past ``used``."""
        if slot not in self.columns:
            return
        start, end = self.columns.pop(slot)
        width, used = end - start, self.used
        if end < used:
            overlap = used - width > end  # then the rows moving up pass over their own old place
            for tensor in (self.a, self.bt, self.column_slots):
                moving = tensor[end:used]
                tensor[start:used - width].copy_(moving.clone() if overlap else moving)
        if self.reserved:
            self.a[used - width:used].zero_()
            self.bt[used - width:used].zero_()
            self.column_slots[used - width:used].fill_(-1)
        self.used = used - width
        self.columns = {s: (lo - width, hi - width) if lo >= end else (lo, hi) for s, (lo, hi) in self.columns.items()}

    def reserve(self, device: torch.device, dtype: torch.dtype, a: torch.Tensor | None = None,
                column_slots: torch.Tensor | None = None) -> None:
        """Allocate the tensors at capacity (keeping what they hold); they never move again.
        ``a`` ([capacity, in], zero) and ``column_slots`` ([capacity], -1): rows of tensors shared
        with the projection's other parts, to hold this part's instead of its own."""
        if self.capacity and (self.a is None or self.a.shape[0] < self.capacity or a is not None):
            self._allocate(self.capacity, device, dtype, a, column_slots)
        self.reserved = True

    def _allocate(self, rows: int, device: torch.device, dtype: torch.dtype, a: torch.Tensor | None = None,
                  column_slots: torch.Tensor | None = None) -> None:
        if self.reserved:
            raise RuntimeError("a reserved LoRA stack never reallocates")
        if a is None:
            a = torch.zeros(rows, self.in_features, dtype=dtype, device=device)
            column_slots = torch.full((rows,), -1, dtype=torch.int64, device=device)
        bt = torch.zeros(rows, self.end - self.offset, dtype=dtype, device=device)
        if self.a is not None:
            a[:self.used], bt[:self.used] = self.a[:self.used], self.bt[:self.used]
            column_slots[:self.used] = self.column_slots[:self.used]
        self.a, self.bt, self.column_slots = a, bt, column_slots
