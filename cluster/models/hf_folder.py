"""A model as Hugging Face folder on disk, and reading its weights.

:class:`ModelSource` is the one shape of model everything downstream sees (whatever the
user typed, :func:`cluster.models.loader.resolve_model` turns it into one).
:class:`ModelLoadError` is every problem with a model's files, here and in the loader,
the GGUF conversion and the shipped drafts: the message names the file and says what
is allowed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from safetensors import safe_open

if TYPE_CHECKING:
    import torch


class ModelLoadError(ValueError):
    """A model could not be found or read; the message says what and what is allowed."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: ``path`` is a Hugging Face folder holding ``config.json``,
    at least one ``*.safetensors`` file and (normally) the tokenizer files."""

    name: str  # what the user asked for
    path: Path


def check_hf_folder(path: Path) -> Path:
    """Check a folder looks like a Hugging Face checkpoint; read each weight header."""
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        hint = f"; to use a GGUF file, pass its path, e.g. {ggufs[0]}" if ggufs else ""
        raise ModelLoadError(
            f"{path} is not a Hugging Face model folder: config.json is missing "
            f"(a model folder needs config.json and *.safetensors){hint}"
        )
    for file in _weight_files(path):  # headers only: cheap, catches truncated or garbage files early
        with _open_weights(file):
            pass
    return path


def iter_weights(source: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(HF parameter name, tensor)`` for every tensor of the folder's weight files.

    Files come from ``model.safetensors.index.json`` when present (sharded
    checkpoints), else every ``*.safetensors`` in the folder, in sorted order.
    Tensors keep their stored dtype. A tied ``lm_head`` is absent when the
    checkpoint omits it (``config.tie_word_embeddings``); the model ties it.
    """
    for file in _weight_files(source.path):
        with _open_weights(file) as f:
            for name in f.keys():
                try:
                    tensor = f.get_tensor(name)
                except Exception as exc:
                    raise ModelLoadError(f"corrupt weights file {file} (tensor {name}): {exc}") from exc
                yield name, tensor


class LazyTensor:
    """A checkpoint tensor not read yet: ``narrow`` reads only the slice asked for (a
    tensor-parallel rank's shard), ``full`` reads all of it."""

    def __init__(self, handle, name: str, file: Path) -> None:
        self._handle, self._slice = handle, handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())
        self._name, self._file = name, file

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * dim + [slice(start, start + length)]
        return self._read(lambda: self._slice[tuple(index)])

    def full(self) -> torch.Tensor:
        return self._read(lambda: self._handle.get_tensor(self._name))

    def _read(self, read) -> torch.Tensor:
        try:
            return read()
        except Exception as exc:
            raise ModelLoadError(f"corrupt weights file {self._file} (tensor {self._name}): {exc}") from exc


def iter_lazy_weights(source: ModelSource) -> Iterator[tuple[str, LazyTensor]]:
    """Like :func:`iter_weights`, but each tensor is read only when (and as far as) asked."""
    for file in _weight_files(source.path):
        with _open_weights(file) as f:
            for name in f.keys():
                yield name, LazyTensor(f, name, file)


def _open_weights(file: Path):
    """``safe_open`` the file (reads and checks the header), or raise ModelLoadError naming it."""
    try:
        return safe_open(str(file), framework="pt")
    except Exception as exc:  # SafetensorError, OSError, ...: report the file, not the library
        raise ModelLoadError(f"corrupt or unreadable weights file {file}: {exc}") from exc


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [path / name for name in sorted(set(weight_map.values()))]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"corrupt safetensors index {index}: {exc}") from exc
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists weight files that are missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        found = f" (found {bins[:3]}; only safetensors is supported)" if bins else ""
        raise ModelLoadError(f"{path} has config.json but no *.safetensors weight files{found}")
    return files
