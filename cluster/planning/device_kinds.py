"""How much memory one device of a kind offers, for planning before anything is placed.

GPU figures are what ``nvidia-smi`` reports as the card's total (MiB), from the vendors'
datasheets; a CUDA context, cuBLAS workspaces and the allocator's fragmentation take some of
it before the engine allocates anything (``GPU_RESERVED_BYTES``, counted per GPU). A CPU
group's device is its host: the Kubernetes group's ``memory`` when one is set, else this
machine's RAM.
"""

from __future__ import annotations

import os

_MIB = 1 << 20
_GIB = 1 << 30

GPU_MEMORY_BYTES: dict[str, int] = {
    "L4": 23_034 * _MIB,  # 24 GB
    "A10G": 23_028 * _MIB,  # 24 GB
    "A10": 23_028 * _MIB,
    "L40S": 46_068 * _MIB,  # 48 GB
    "A100-40GB": 40_960 * _MIB,
    "A100": 81_920 * _MIB,  # the 80 GB card; say A100-40GB for the other
    "A100-80GB": 81_920 * _MIB,
    "H100": 81_559 * _MIB,  # 80 GB SXM / PCIe
    "H200": 143_771 * _MIB,  # 141 GB
}
GPU_RESERVED_BYTES = 1 * _GIB  # CUDA context, library workspaces, allocator slack: per GPU


def device_memory_bytes(device_kind: str, host_memory_bytes: int | None = None) -> tuple[int | None, int]:
    """(total bytes of one device of this kind, bytes reserved on it before the engine): None
    when the kind is unknown. ``cpu`` is the host (``host_memory_bytes`` or this machine's RAM)."""
    kind = device_kind.upper()
    if kind == "CPU":
        return (host_memory_bytes or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")), 0
    for name, total in GPU_MEMORY_BYTES.items():
        if kind == name or kind.replace("_", "-") == name:
            return total, GPU_RESERVED_BYTES
    return None, GPU_RESERVED_BYTES


def known_kinds() -> list[str]:
    return ["cpu", *GPU_MEMORY_BYTES]
