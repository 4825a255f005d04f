"""What this machine's CPU is, read from /proc/cpuinfo (Linux; empty elsewhere): its feature
flags, which choose and key the compiled kernels, and its model and vector kind, which every
benchmark figure names."""

from __future__ import annotations

import platform
from pathlib import Path


def _field(name: str) -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> str:
    """The first CPU's feature flags, space-separated."""
    return _field("flags")


def cpu_model() -> str:
    return _field("model name") or platform.processor() or platform.machine()


def cpu_kind(flags: set[str] | None = None) -> str:
    """The vector extensions that choose kernels here, in the words the docs use
    ("AVX-512 with BF16, VNNI, AMX", "AVX2")."""
    flags = set(cpu_flags().split()) if flags is None else flags
    if "avx512f" in flags:
        extras = [name for flag, name in (("avx512_bf16", "BF16"), ("avx512_vnni", "VNNI"), ("amx_tile", "AMX"))
                  if flag in flags]
        return "AVX-512" + (f" with {', '.join(extras)}" if extras else "")
    if "avx2" in flags:
        return "AVX2"
    return platform.machine() or "unknown"
