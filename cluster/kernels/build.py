"""Build the CPU kernels of this package once per machine and load them.

The C++ sources are compiled for the host CPU (``-march=native``) with torch's extension
builder (gcc and ninja) the first time a process asks for them, into
``<cache dir>/kernels/<key>``; the key hashes the source and headers, the torch version, where
that torch is installed and the CPU's flags, so a cache shared by different machines never
hands one a build for another, and environments sharing one machine's cache (the project's
and the vLLM tier's, each with its own torch) keep a build each instead of rebuilding in turn
(torch's builder rebuilds when the include paths in its command change: about 100 s of two
cores, which `tandem serve` spent loading after the vLLM tier had run). Later processes load
the built library in well under a second.

Builds and loads of one kernel take turns under a file lock that dies with its holder, so a
process killed mid-build never leaves the next one waiting (torch's builder alone would).

Where the build cannot happen (no compiler, a CPU without AVX2/FMA, a build error),
:func:`small_gemm`, :func:`widening_gemm`, :func:`pair_gemm`, :func:`lowbit_gemm`, :func:`gguf_gemm`, :func:`decode_ops` and
:func:`prefill_attention` return None with a logged reason
and callers keep torch's own kernels. ``TANDEM_CPU_KERNELS=0`` turns the kernels off (for A/B runs and as an escape
hatch).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

import torch
from torch.utils import cpp_extension

from cluster.shared.cache_dir import default_cache_dir
from cluster.shared.cpu_info import cpu_flags

logger = logging.getLogger(__name__)

_SOURCE_DIR = Path(__file__).resolve().parent
_DISABLE_ENV = "TANDEM_CPU_KERNELS"


def cpu_has_vectors() -> bool:
    """Whether this CPU has what the kernels are written for: AVX2 with FMA, or AVX-512."""
    flags = set(cpu_flags().split())
    return {"avx2", "fma"} <= flags or "avx512f" in flags


def kernels_enabled() -> bool:
    return os.environ.get(_DISABLE_ENV, "1") not in ("0", "false", "off")


def build_key(source: Path, torch_dir: Path) -> str:
    """What names a build: the source and headers, torch's version and location, the CPU."""
    digest = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(_SOURCE_DIR.glob("*.h"))]
    for part in (source.read_bytes(), *headers, torch.__version__.encode(), str(torch_dir).encode(),
                 cpu_flags().encode()):
        digest.update(part)
    return digest.hexdigest()[:16]


def _build_dir(name: str, source: Path) -> tuple[str, Path]:
    key = build_key(source, Path(torch.__file__).resolve().parent)
    folder = default_cache_dir() / "kernels" / f"{name}-{key}"
    folder.mkdir(parents=True, exist_ok=True)
    return f"tandem_{name}_{key}", folder


def small_gemm() -> ModuleType | None:
    """The compiled few-row GEMM (``small_gemm.cpp``), or None where it cannot run."""
    return _load("small_gemm")


def widening_gemm() -> ModuleType | None:
    """The compiled many-row GEMM on bfloat16 weights in float32 arithmetic (``widening_gemm.cpp``),
    or None where it cannot run (it needs AVX-512)."""
    module = _load("widening_gemm")
    return module if module is not None and module.available else None


def pair_gemm() -> ModuleType | None:
    """The compiled many-row GEMM on bfloat16 weights with the CPU's bfloat16 pair product
    (``pair_gemm.cpp``), or None where it cannot run (it needs AVX-512-BF16)."""
    module = _load("pair_gemm")
    return module if module is not None and module.available else None


def lowbit_gemm() -> ModuleType | None:
    """The compiled few-row GEMMs on int8 and 4-bit weights (``lowbit_gemm.cpp``), or None where they cannot run."""
    return _load("lowbit_gemm")


def gguf_gemm() -> ModuleType | None:
    """The compiled few-row GEMM on GGUF's quantized blocks (``gguf_gemm.cpp``), or None where it cannot run."""
    return _load("gguf_gemm")


def prefill_attention() -> ModuleType | None:
    """The compiled prefill attention (``prefill_attention.cpp``), or None where it cannot run (it needs
    AVX-512)."""
    module = _load("prefill_attention")
    return module if module is not None and module.available else None


def decode_ops() -> ModuleType | None:
    """The compiled decode-step operations (``decode_ops.cpp``), or None where they cannot run."""
    return _load("decode_ops")


@functools.lru_cache(maxsize=None)
def _load(name: str) -> ModuleType | None:
    if not kernels_enabled():
        logger.info("CPU kernels turned off by %s", _DISABLE_ENV)
        return None
    if not cpu_has_vectors():
        logger.info("no AVX2/FMA on this CPU: torch's own kernels are used")
        return None
    source = _SOURCE_DIR / f"{name}.cpp"
    try:
        module_name, folder = _build_dir(name, source)
        with _build_lock(folder):
            return cpp_extension.load(
                name=module_name,
                sources=[str(source)],
                build_directory=str(folder),
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
    except Exception as err:  # a missing compiler, ninja or header: fall back, never fail the model
        logger.warning("could not build the CPU kernel %s (%s); using torch's own kernels", name, err)
        return None


@contextlib.contextmanager
def _build_lock(folder: Path):
    """One process at a time builds or loads in ``folder``, under an ``flock`` the kernel drops
    when its holder dies. torch's own lock (a file named ``lock`` that its builder waits on until
    it disappears) outlives a process killed mid-build and then blocked every later start; found
    while holding ours, it can only be such a leftover, so it is removed."""
    with open(folder / "tandem.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = folder / "lock"
            if stale.exists():
                logger.warning("removing %s, left by a kernel build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)

