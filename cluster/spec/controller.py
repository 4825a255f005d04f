"""The speculation controller: batch state in, speculation length ``k`` out.

``k = 0`` means plain decoding for that step. This file holds the interface and the
fixed-``k`` controller; the adaptive one (profiled per batch size, re-fitted online)
implements the same interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class BatchState:
    num_running: int  # requests holding KV blocks, decoding or in prefill
    num_waiting: int


class SpeculationController(Protocol):
    def choose_k(self, state: BatchState) -> int: ...


@dataclass(frozen=True)
class FixedController:
    k: int

    def choose_k(self, state: BatchState) -> int:
        return self.k
