"""EAGLE-3 heads that ship inside the package, each a published-layout folder under
``cluster/models/shipped_weights/``, named by ``speculative.draft_model``."""

from __future__ import annotations

from pathlib import Path

from cluster.models.hf_folder import ModelLoadError

WEIGHTS_DIR = Path(__file__).resolve().parent / "shipped_weights"

SHIPPED_HEADS: dict[str, str] = {  # head name -> the target (short name) it was trained for
    "smollm2-135m-instruct-eagle3": "smollm2-135m-instruct",
}


def resolve_head(name: str) -> Path:
    """A shipped head's folder, or ``name`` itself as a folder; raises ModelLoadError."""
    if name in SHIPPED_HEADS:
        folder = WEIGHTS_DIR / name
        if not (folder / "config.json").is_file():
            raise ModelLoadError(f"the shipped head {name!r} is missing its files in {folder}; reinstall the "
                                 "package or train one with `tandem draft train`")
        return folder
    folder = Path(name).expanduser()
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{name!r} is neither a shipped EAGLE-3 head ({', '.join(SHIPPED_HEADS)}) nor a "
                             "folder with a config.json")
    return folder
