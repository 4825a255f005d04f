"""Tiny random-weight Hugging Face configs of each family, for tests and smoke runs."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import AutoModelForCausalLM, LlamaConfig, OPTConfig, PreTrainedTokenizerFast, Qwen2Config

TINY_VOCAB = 256


def tiny_llama_config(**overrides) -> LlamaConfig:
    """2 layers, GQA (4 query heads over 2 KV heads), tied embeddings."""
    values = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def tiny_qwen2_config(**overrides):
    """The Llama family with a QKV bias (Qwen2), an untied head and llama3 RoPE scaling."""
    values = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
    )
    values.update(overrides)
    return Qwen2Config(**values)


def tiny_opt_config(**overrides) -> OPTConfig:
    values = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=512, word_embed_proj_dim=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, do_layer_norm_before=True,
    )
    values.update(overrides)
    return OPTConfig(**values)


def save_tiny_model(config, path: Path, seed: int = 0) -> Path:
    """Build the HF model for ``config`` with random weights from ``seed`` and save it.

    Weights are scaled up from HF's tiny init, and biases made non-zero, so that
    greedy decoding is not trivially repetitive and a dropped bias shows.
    """
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(path)
    return Path(path)


def save_noisy_draft(target_dir: Path, path: Path, seed: int = 1, noise: float = 0.3) -> Path:
    """A draft that agrees with the target often but not always: the target's weights plus
    Gaussian noise of ``noise`` times each tensor's standard deviation (``seed`` fixes it)."""
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * noise * p.std())
    model.save_pretrained(path)
    return Path(path)


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def save_tiny_tokenizer(path: Path, vocab_size: int = TINY_VOCAB, chat_template: str | None = None) -> Path:
    """A character-level tokenizer: ids 0-2 are <unk>, <s>, </s>, then printable ASCII.

    It lets tiny models take text prompts, stop strings and chat-free tests without any
    download. Ids beyond the characters decode to filler tokens ``<tN>``.
    """
    specials = ["<unk>", "<s>", "</s>"]
    chars = [chr(c) for c in range(32, 127)]
    tokens = specials + chars
    tokens += [f"<t{i}>" for i in range(len(tokens), vocab_size)]
    vocab = {tok: i for i, tok in enumerate(tokens[:vocab_size])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    return Path(path)
