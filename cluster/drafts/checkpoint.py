"""Atomic save and load of a distillation run's state (one ``torch.save`` file).

A checkpoint is written to a temporary file and renamed into place, so ``state.pt``
is always either the previous complete state or the new complete one, never half
of each, even when the run is killed while saving.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


def save_state(path: Path, **state) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_state(path: Path) -> dict | None:
    """The saved state, or None when there is none yet."""
    if not path.is_file():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise ValueError(f"cannot read the checkpoint {path} ({exc}); delete it to start over") from exc
