"""The device a setting names."""

from __future__ import annotations

import torch


def default_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
