"""A training run's state: atomic save and load (one ``torch.save`` file), the check that a
resumed run asks for the settings it was started with, and the learning-rate schedule.

A checkpoint is written to a temporary file and renamed into place, so ``state.pt``
is always either the previous complete state or the new complete one, never half
of each, even when the run is killed while saving.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict
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


def check_same_settings(saved: dict, settings, ckpt_dir: Path) -> None:
    """Refuse to resume a run (``saved``: its settings as a dict) with other ``settings`` (a
    dataclass); ``checkpoint_every`` may change."""
    saved = {**saved, "checkpoint_every": settings.checkpoint_every}
    if saved != asdict(settings):
        changed = ", ".join(f"{k}: was {saved.get(k)}, now {v}" for k, v in asdict(settings).items()
                            if saved.get(k) != v)
        raise ValueError(f"{ckpt_dir} holds a run with other settings ({changed}); "
                         "resume with the same settings or use another output folder")


def warmup_cosine(step: int, steps: int, warmup_steps: int, lr: float, floor: float) -> float:
    """Linear warm-up (at most a fifth of the steps), then cosine decay to ``floor`` times ``lr``."""
    warmup = min(warmup_steps, steps // 5)
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))
