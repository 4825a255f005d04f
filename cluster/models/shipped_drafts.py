"""Drafts that ship inside the package as their own tensors only.

A distilled draft shares its tied embedding/head with its target, so what is its own
(the decoder layers it kept and its final norm) is small. The package carries those
tensors in ``cluster/models/shipped_weights/<name>.safetensors`` (float16 storage), with the
draft's ``config.json`` in the file's metadata. :func:`materialize_draft` builds the
full Hugging Face folder once, from those tensors plus the target's converted weights
and tokenizer, under ``<cache_dir>/drafts/<name>-<key>/`` where ``key`` hashes the
shipped file and the target folder's name (both fix the content). Like the GGUF
conversion, the folder is built in a temporary folder and renamed into place, so a
folder with the final name is complete.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from cluster.models.hf_folder import ModelLoadError, ModelSource, iter_weights

WEIGHTS_DIR = Path(__file__).resolve().parent / "shipped_weights"
FORMAT = "tandem-draft-own-tensors-1"
_SHARED = ("model.embed_tokens.weight",)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt", "chat_template.jinja")


@dataclass(frozen=True)
class ShippedDraft:
    target: str  # short name of the target whose embedding the draft shares
    weights: str  # file under WEIGHTS_DIR


SHIPPED_DRAFTS: dict[str, ShippedDraft] = {
    "smollm2-135m-instruct-draft": ShippedDraft("smollm2-135m-instruct", "smollm2-135m-instruct-draft.safetensors"),
}


def export_own_tensors(draft_dir: Path, path: Path, target_name: str, dtype: str = "float16") -> int:
    """Write the own tensors of the HF draft folder ``draft_dir`` to ``path``; returns bytes written."""
    source = ModelSource(name=str(draft_dir), path=Path(draft_dir))
    own = {name: t.to(getattr(torch, dtype)).contiguous() for name, t in iter_weights(source)
           if name not in _SHARED and name != "lm_head.weight"}
    config = json.loads((Path(draft_dir) / "config.json").read_text())
    if not config.get("tie_word_embeddings", False):
        raise ValueError(f"{draft_dir}: only drafts with an embedding tied to the head can ship as own tensors")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(own, str(path), metadata={"format": FORMAT, "target": target_name, "config": json.dumps(config)})
    return path.stat().st_size


def materialize_draft(name: str, target: ModelSource, cache_dir: Path) -> Path:
    """The full HF folder of shipped draft ``name``, built once under ``cache_dir``; ``target``
    is its resolved target (``SHIPPED_DRAFTS[name].target``)."""
    draft = SHIPPED_DRAFTS[name]
    weights = WEIGHTS_DIR / draft.weights
    if not weights.is_file():
        raise ModelLoadError(f"the shipped draft {name!r} is missing its weights file {weights}; "
                             "reinstall the package or distill one with `tandem draft distill`")
    key = hashlib.sha256(weights.read_bytes() + target.path.name.encode()).hexdigest()[:12]
    out = cache_dir / "drafts" / f"{name}-{key}"
    if (out / "config.json").is_file():
        return out
    with safe_open(str(weights), framework="pt") as f:
        metadata = f.metadata() or {}
        if metadata.get("format") != FORMAT:
            raise ModelLoadError(f"{weights} is not a shipped draft (format {metadata.get('format')!r})")
        tensors = {k: f.get_tensor(k).to(torch.float32) for k in f.keys()}
    tensors.update({k: t.to(torch.float32) for k, t in iter_weights(target) if k in _SHARED})
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    try:
        (tmp / "config.json").write_text(metadata["config"])
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for file in _TOKENIZER_FILES:
            if (target.path / file).is_file():
                shutil.copyfile(target.path / file, tmp / file)
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").is_file():  # else another process finished first: its folder is complete
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
