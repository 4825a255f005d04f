"""`tandem draft quantize TARGET OUT`: an int8 copy of the target, to serve as its own draft.

Self-speculation: the draft is the target itself with int8 weights (see
:mod:`cluster.quant.checkpoint` for the folder's form). It agrees with the target on
nearly every token (`tandem bench quant` measures how often) and reads a quarter of
the target's float32 weight bytes per step, the LM head included.
"""

from __future__ import annotations

from pathlib import Path

from cluster.models.hf_folder import iter_weights
from cluster.models.loader import resolve_model
from cluster.quant.checkpoint import write_int8_folder
from cluster.quant.int8_linear import SCHEMES


def quantize_draft(target: str, out: Path, scheme: str = "int8", cache_dir: str | None = None) -> dict:
    """Write ``out`` (a Hugging Face folder with int8 linear weights); returns the summary
    of :func:`write_int8_folder` plus the source path. Refuses to overwrite the target."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme {scheme!r} is not supported; use one of {SCHEMES}")
    source = resolve_model(target, Path(cache_dir) if cache_dir else None)
    if out.resolve() == source.path.resolve():
        raise ValueError(f"{out} is the target's own folder; choose another output folder")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty; choose a new folder")
    summary = write_int8_folder(source.path, iter_weights(source), out, scheme)
    return {**summary, "source": str(source.path), "out": str(out), "scheme": scheme}
