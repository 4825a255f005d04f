"""Adapters served on demand from ``model.lora_dir``: a request names one by its folder's name."""

from __future__ import annotations

import re
from pathlib import Path

from cluster.errors import NotFoundError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")  # one folder name, never a path


def is_adapter_name(name: str) -> bool:
    """Whether ``name`` could name an adapter of a ``lora_dir``: one plain folder name."""
    return bool(_NAME.fullmatch(name))


def adapter_folder(lora_dir: str, name: str) -> Path | None:
    """The folder of the adapter ``name`` in ``lora_dir``: None when ``name`` is not one plain folder
    name or the folder holds no ``adapter_config.json`` (from here)."""
    if not is_adapter_name(name):
        return None
    folder = Path(lora_dir).expanduser() / name
    return folder if (folder / "adapter_config.json").is_file() else None


def listed_adapters(lora_dir: str) -> dict[str, str]:
    """Every adapter in ``lora_dir`` seen from here, name -> folder, by name; empty when the folder
    cannot be read (it may live only on the serving nodes)."""
    try:
        entries = sorted(Path(lora_dir).expanduser().iterdir())
    except OSError:
        return {}
    return {entry.name: str(entry) for entry in entries if adapter_folder(lora_dir, entry.name) is not None}


def no_adapter(lora_dir: str, name: str) -> NotFoundError:
    """The 404 of a request naming ``name``, which ``lora_dir`` holds no adapter folder for."""
    return NotFoundError("model", f"the model {name!r} does not exist: no adapter folder {name!r} (with "
                                  f"adapter_config.json) in model.lora_dir {lora_dir}")
