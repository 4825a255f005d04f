"""Target and draft pairs of chosen shapes, for timing the paper's experiment at its proportions.

arXiv 2310.18813's result rests on proportions the embedded 135M target lacks: the target
costs tens of times its draft per token, verifying a few extra tokens is nearly free at batch
1 and heavy at batch 32. A :class:`Proportions` names a target and a draft by shape alone;
:func:`build_pair` writes both with random weights (seeded, in the pair's dtype) as Hugging
Face folders under the cache dir, each with a character-level tokenizer of the pair's
vocabulary, so the engine loads them as any other folders. Random drafts agree with nothing, so
the pair is timed with synthetic acceptance (:mod:`cluster.runner.synthetic_acceptance`) on
random prompts of a fixed length (:func:`random_prompt_ids`).

Pairs: ``paper`` is the paper's own (OPT-6.7B with OPT-125M, float16, for a GPU); ``cpu`` is
a Llama pair scaled for a 2-core CPU (1B-class layers, few of them; docs/speculative-decoding.md
gives what they show); ``tiny`` is for tests and smoke runs.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from cluster.shared.cache_dir import default_cache_dir

FIRST_TEXT_ID = 3  # ids 0-2 are the character tokenizer's <unk>, <s> and </s>


@dataclass(frozen=True)
class ModelShape:
    family: str  # "llama" or "opt"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # equal to num_heads for OPT
    vocab_size: int
    max_position_embeddings: int = 2048

    def hf_config(self):
        from transformers import LlamaConfig, OPTConfig

        common = dict(vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_layers,
                      num_attention_heads=self.num_heads, max_position_embeddings=self.max_position_embeddings,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
        if self.family == "llama":
            return LlamaConfig(intermediate_size=self.intermediate_size, num_key_value_heads=self.num_kv_heads,
                               tie_word_embeddings=False, **common)
        if self.family == "opt":
            if self.num_kv_heads != self.num_heads:
                raise ValueError("OPT has no grouped-query attention: num_kv_heads must equal num_heads")
            return OPTConfig(ffn_dim=self.intermediate_size, word_embed_proj_dim=self.hidden_size,
                             do_layer_norm_before=True, **common)
        raise ValueError(f"model family must be llama or opt, got {self.family!r}")

    def num_parameters(self) -> int:
        """Weights read per token: every layer's matrices and the head (not the embedding)."""
        h, f, head_dim = self.hidden_size, self.intermediate_size, self.hidden_size // self.num_heads
        attention = 2 * h * h + 2 * h * self.num_kv_heads * head_dim
        mlp = (3 if self.family == "llama" else 2) * h * f
        return self.num_layers * (attention + mlp) + h * self.vocab_size


@dataclass(frozen=True)
class Proportions:
    name: str
    target: ModelShape
    draft: ModelShape
    dtype: str
    why: str

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


PAIRS = {
    "paper": Proportions(
        "paper",
        target=ModelShape("opt", 4096, 16384, 32, 32, 32, 50272),  # OPT-6.7B
        draft=ModelShape("opt", 768, 3072, 12, 12, 12, 50272),  # OPT-125M
        dtype="float16",
        why="the paper's pair (OPT-6.7B with OPT-125M), for a GPU: the target reads 54x the draft's weights"),
    "cpu": Proportions(
        "cpu",
        # TinyLlama-1.1B's layer (GQA, 4 KV heads), six of them: 281 M weights read per token.
        target=ModelShape("llama", 2048, 5632, 6, 32, 4, 8192),
        # A quarter of the width, two layers: 10 M weights, 1/28 of the target's (OPT-125M is
        # 1/54 of OPT-6.7B; a pass's fixed cost on a CPU keeps a smaller draft from costing less).
        draft=ModelShape("llama", 512, 1408, 2, 8, 4, 8192),
        dtype="bfloat16",
        why="scaled for a 2-core CPU: 1B-class layers, whose bfloat16 GEMMs cost little more for a few rows than "
            "for one and grow with rows past that, so verification is nearly free at batch 1 and heavy at batch 32"),
    "tiny": Proportions(
        "tiny",
        target=ModelShape("llama", 64, 128, 2, 4, 2, 256, max_position_embeddings=1024),
        draft=ModelShape("llama", 32, 64, 1, 2, 1, 256, max_position_embeddings=1024),
        dtype="float32",
        why="for tests and smoke runs"),
}


class PairFolders(NamedTuple):
    target: Path
    draft: Path


def get_pair(name: str) -> Proportions:
    if name not in PAIRS:
        raise ValueError(f"unknown proportions {name!r}; choose one of {', '.join(PAIRS)}")
    return PAIRS[name]


def build_pair(pair: Proportions, cache_dir: Path | None = None, seed: int = 0) -> PairFolders:
    """The pair's folders, written once (random weights from ``seed``) and reused after."""
    root = (cache_dir or default_cache_dir()) / "bench" / "proportions" / f"{pair.name}-{pair.key()}-{seed}"
    folders = PairFolders(root / "target", root / "draft")
    for shape, folder, offset in ((pair.target, folders.target, 0), (pair.draft, folders.draft, 1)):
        if not (folder / "config.json").exists() or not (folder / "tokenizer.json").exists():
            _write_model(shape, folder, getattr(torch, pair.dtype), seed + offset)
    return folders


def _write_model(shape: ModelShape, folder: Path, dtype: torch.dtype, seed: int) -> None:
    from transformers import AutoModelForCausalLM

    from cluster.models.tiny import save_tiny_tokenizer

    torch.manual_seed(seed)
    partial = folder.with_name(folder.name + ".partial")  # a build cut short is never taken for a whole one
    model = AutoModelForCausalLM.from_config(shape.hf_config(), dtype=dtype)  # HF's init: finite in float16
    model.save_pretrained(partial)
    save_tiny_tokenizer(partial, vocab_size=shape.vocab_size)
    del model
    if folder.exists():
        shutil.rmtree(folder)
    partial.rename(folder)


def random_prompt_ids(vocab_size: int, num_prompts: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """``num_prompts`` prompts of ``prompt_len`` token ids drawn uniformly past the special ids."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(FIRST_TEXT_ID, vocab_size, (num_prompts, prompt_len), generator=generator)
    return ids.tolist()
