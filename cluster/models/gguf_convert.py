"""Convert a llama-architecture GGUF file into a Hugging Face folder, once.

The folder holds ``config.json`` (a ``LlamaConfig`` built from the GGUF
metadata), ``model.safetensors`` (every tensor dequantized to float32 under its
Hugging Face name) and the tokenizer that ``transformers`` builds from the GGUF
(``tokenizer.json``, ``tokenizer_config.json`` with the chat template), and beside them, in
``gguf_blocks/``, every linear-layer tensor of a served block format as the file holds it
(:mod:`cluster.models.gguf_blocks`), for ``model.quantization: gguf``.

Invariants:

- The result lives at ``<cache_dir>/converted/<stem>-<key>/`` where ``key``
  hashes the file's size, mtime and :data:`_FORMAT_VERSION`; a folder with that
  name is complete, because it is built in a temporary folder and renamed into
  place in one step. A second call returns it without reading the GGUF.
- llama.cpp stores the rows of each Q and K projection permuted so that the two
  halves of a rotary pair are adjacent (interleaved RoPE); Hugging Face Llama
  keeps them half a head apart (``rotate_half``). :func:`unpermute_rope_rows`
  undoes that, so the weights are the ones the original checkpoint had.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import gguf
import numpy as np
import torch
from gguf.quants import dequantize
from safetensors.torch import save_file
from transformers import AutoTokenizer, LlamaConfig

from cluster.models.gguf_blocks import FORMAT_OF_TYPE, write_blocks
from cluster.models.hf_folder import ModelLoadError

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama",)  # llama covers SmolLM, Llama 1/2/3, Mistral
_FORMAT_VERSION = 2  # bump when the converted layout changes: old cache entries are then ignored

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def converted_dir(gguf_path: Path, cache_dir: Path) -> Path:
    """Where :func:`convert_gguf` puts (or has put) the folder for ``gguf_path``."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}:{_FORMAT_VERSION}".encode()).hexdigest()
    return cache_dir / "converted" / f"{gguf_path.stem}-{key[:12]}"


def convert_gguf(gguf_path: Path, cache_dir: Path) -> Path:
    """Return the Hugging Face folder for ``gguf_path``, converting it on first use."""
    target = converted_dir(gguf_path, cache_dir)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        logger.info("converting %s into %s (once)", gguf_path, target)
        write_hf_folder(gguf_path, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private
        try:
            os.rename(tmp, target)  # atomic; fails if another process got there first
        except OSError as exc:
            if not (target / "config.json").is_file():
                raise ModelLoadError(f"cannot create {target} ({exc}); delete it and retry") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def write_hf_folder(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, model.safetensors and the tokenizer of ``gguf_path`` into ``out_dir``."""
    reader = open_gguf(gguf_path)
    config = build_llama_config(reader, gguf_path)
    tensors = dict(iter_hf_tensors(reader, config, gguf_path))
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    write_blocks(out_dir, dict(iter_quantized_rows(reader, config)))
    config.save_pretrained(str(out_dir))
    _save_tokenizer(reader, gguf_path, out_dir)


def open_gguf(gguf_path: Path) -> gguf.GGUFReader:
    """A ``gguf.GGUFReader`` for the file, or ModelLoadError naming it."""
    try:
        return gguf.GGUFReader(str(gguf_path))
    except Exception as exc:  # bad magic, truncated header or data: report the file
        raise ModelLoadError(f"corrupt or unreadable GGUF file {gguf_path}: {exc}") from exc


def build_llama_config(reader: Any, gguf_path: Path) -> LlamaConfig:
    """A ``transformers.LlamaConfig`` from the GGUF metadata and tensor list."""
    arch = _field(reader, "general.architecture", gguf_path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{gguf_path}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (SmolLM, Llama, Mistral)"
        )

    def meta(key: str, default: Any = ...) -> Any:
        return _field(reader, f"{arch}.{key}", gguf_path, default)

    if meta("expert_count", 0):
        raise ModelLoadError(f"{gguf_path}: mixture-of-experts llama GGUFs are not supported")
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ModelLoadError(
            f"{gguf_path}: per-frequency RoPE factors (rope_freqs, Llama 3.1 style) are not "
            "supported; supported RoPE scaling: none, linear, yarn"
        )
    hidden_size = int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden_size // num_heads))
    if int(meta("rope.dimension_count", head_dim)) != head_dim:
        raise ModelLoadError(f"{gguf_path}: partial rotary embeddings are not supported for llama")
    rope = {"rope_type": "default", "rope_theta": float(meta("rope.freq_base", 10000.0))}
    scaling = meta("rope.scaling.type", "none")
    if scaling in ("linear", "yarn"):
        rope.update(rope_type=scaling, factor=_f32(meta("rope.scaling.factor")))
        if scaling == "yarn":
            rope["original_max_position_embeddings"] = int(meta("rope.scaling.original_context_length"))
    elif scaling != "none":
        raise ModelLoadError(f"{gguf_path}: RoPE scaling {scaling!r} is not supported (none, linear, yarn)")
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ModelLoadError(f"{gguf_path}: tensor token_embd.weight is missing")
    token_id = lambda key: _field(reader, f"tokenizer.ggml.{key}", gguf_path, None)  # noqa: E731
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=int(embed.shape[-1]),  # GGUF shapes are reversed: [hidden, vocab]
        hidden_size=hidden_size,
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        max_position_embeddings=int(meta("context_length")),
        rms_norm_eps=_f32(meta("attention.layer_norm_rms_epsilon")),
        rope_parameters=rope,
        bos_token_id=token_id("bos_token_id"),
        eos_token_id=token_id("eos_token_id"),
        pad_token_id=token_id("padding_token_id"),
        tie_word_embeddings="output.weight" not in tensor_names,
        dtype="float32",
    )


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face Llama name of a GGUF tensor, or None if it has none."""
    base, _, suffix = gguf_name.rpartition(".")
    if suffix != "weight":
        return None
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.weight"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}.weight"
    return None


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation. ``weight``: [num_heads * head_dim, in_features].

    llama.cpp orders each head's rows as pairs ``(r[i], r[i + head_dim/2])``;
    Hugging Face keeps the first half of the head, then the second half.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ModelLoadError(f"cannot split {rows} rows into {num_heads} heads of even size")
    pairs = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return pairs.swapaxes(1, 2).reshape(weight.shape)


def iter_hf_tensors(reader: Any, config: LlamaConfig, gguf_path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(HF name, float32 tensor)`` for every GGUF tensor, dequantized and un-permuted."""
    expected = _expected_shapes(config)
    shapes = {hf_tensor_name(t.name): tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    unknown = [t.name for t in reader.tensors if hf_tensor_name(t.name) is None]
    missing = sorted(set(expected) - set(shapes))
    wrong = [f"{n}: {shapes[n]} != {expected[n]}" for n in expected if n in shapes and shapes[n] != expected[n]]
    if unknown or missing or wrong:
        raise ModelLoadError(
            f"{gguf_path} does not match a llama model of its own metadata: "
            f"unexpected tensors {unknown[:5]}, missing {missing[:5]}, wrong shapes {wrong[:5]}"
        )
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        try:
            weight = dequantize(t.data, t.tensor_type).reshape(shapes[name])
        except Exception as exc:  # unknown quant type, truncated data
            raise ModelLoadError(
                f"cannot dequantize tensor {t.name} ({t.tensor_type.name}) of {gguf_path}: {exc}"
            ) from exc
        if ".self_attn.q_proj." in name:
            weight = unpermute_rope_rows(weight, config.num_attention_heads)
        elif ".self_attn.k_proj." in name:
            weight = unpermute_rope_rows(weight, config.num_key_value_heads)
        yield name, torch.from_numpy(np.array(weight, dtype=np.float32, order="C"))  # copies out of the mmap


def iter_quantized_rows(reader: Any, config: LlamaConfig) -> Iterator[tuple[str, tuple[torch.Tensor, str]]]:
    """Yield ``(HF name, (raw rows [N, row_bytes] uint8, format name))`` for every 2-D tensor held in a
    served block format, Q and K rows un-permuted as in :func:`iter_hf_tensors`; bytes, never widened."""
    for t in reader.tensors:
        fmt = FORMAT_OF_TYPE.get(int(t.tensor_type))
        name = hf_tensor_name(t.name)
        if fmt is None or name is None or len(t.shape) != 2:
            continue
        rows = np.asarray(t.data, dtype=np.uint8).reshape(int(t.shape[1]), -1)
        if ".self_attn.q_proj." in name:
            rows = unpermute_rope_rows(rows, config.num_attention_heads)
        elif ".self_attn.k_proj." in name:
            rows = unpermute_rope_rows(rows, config.num_key_value_heads)
        yield name, (torch.from_numpy(np.array(rows, order="C")), fmt.name)  # copies out of the mmap


def _expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    h, inter, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    per_layer = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                 "self_attn.o_proj": (h, q), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
                 "mlp.down_proj": (h, inter), "input_layernorm": (h,), "post_attention_layernorm": (h,)}  # fmt: skip
    for i in range(config.num_hidden_layers):
        shapes.update({f"model.layers.{i}.{k}.weight": v for k, v in per_layer.items()})
    return shapes


def _save_tokenizer(reader: Any, gguf_path: Path, out_dir: Path) -> None:
    """Build the tokenizer transformers makes from the GGUF and save it, chat template included."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
        )
    except Exception as exc:
        raise ModelLoadError(f"cannot build a tokenizer from {gguf_path}: {exc}") from exc
    template = _field(reader, "tokenizer.chat_template", gguf_path, None)
    if template and not tokenizer.chat_template:
        tokenizer.chat_template = template
    # save_jinja_files=False keeps the template inside tokenizer_config.json, where every reader looks
    tokenizer.save_pretrained(str(out_dir), save_jinja_files=False)


def _field(reader: Any, key: str, gguf_path: Path, default: Any = ...) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise ModelLoadError(f"{gguf_path}: required GGUF metadata {key!r} is missing")
        return default
    return field.contents()


def _f32(value: float) -> float:
    """GGUF stores float32: give back its shortest decimal (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))
