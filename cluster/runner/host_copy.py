"""Host values onto the device without making the host wait.

A blocking copy to a CUDA device (``torch.tensor(values, device=cuda)``, ``t.to(cuda)``) waits for
the stream, so the host stops feeding the GPU; the sampling and verification steps build their
small index and parameter tensors on the host and copy them with ``non_blocking=True`` instead
(from pageable memory CUDA stages the bytes before the call returns, so the host buffer may go
at once). On the CPU this is a plain copy.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(values, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    """``values`` (a list, numpy array or host tensor) as a tensor on ``device``."""
    if isinstance(values, np.ndarray):
        host = torch.from_numpy(values)
    elif isinstance(values, torch.Tensor):
        host = values
    else:
        host = torch.tensor(values, dtype=dtype)
    if dtype is not None and host.dtype != dtype:
        host = host.to(dtype)
    return host.to(device, non_blocking=True)
