"""LoRA adapters for tests, made by PEFT (the library that trains and saves them) on a tiny model."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_peft_adapter(base_dir: Path, path: Path, seed: int, targets: list[str] = ALL_TARGETS, rank: int = 4,
                      alpha: int = 8, rslora: bool = False) -> Path:
    """A random-weight adapter of ``base_dir`` (A and B both random, so it changes the outputs), saved as
    PEFT saves a trained one."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                        init_lora_weights=False, lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(path)
    return Path(path)


def reference_greedy(model, prompts: list[list[int]], max_tokens: int, device: str = "cpu") -> list[list[int]]:
    """A transformers or PEFT model's greedy tokens for each prompt, EOS ignored (the reference);
    the model is on ``device``."""
    model.generation_config.eos_token_id = None
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=0)
        outs.append(out[0, len(prompt):].tolist())
    return outs


def peft_model(base_dir: Path, adapter_dir: Path):
    """The base model with the adapter, as PEFT runs it (the reference)."""
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(model, adapter_dir).eval()
