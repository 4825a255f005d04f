"""Distillation text: continuations the target itself writes for the shipped prompts.

The target samples ``num_samples`` answers (round-robin over the prompts, request ``i``
seeded with ``seed + i``) through Tandem's own engine, all in one continuous batch.
Each sample is one training row: chat-formatted prompt + answer, cut to ``seq_len``.
Rows are right-padded; with causal attention a real token never sees padding, so only
the loss is masked. Prompts whose index is a multiple of ``HOLDOUT_EVERY`` are held
out: their rows measure the draft on prompts it was not trained on.

The samples are written once to ``<checkpoint>/samples.json`` with the settings that
made them; a resumed run reads them back instead of generating again.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from cluster.engine.llm import LLM, user_prompt_text
from cluster.shared.sampling_params import SamplingParams

INSTRUCTIONS_PATH = Path(__file__).resolve().parent.parent / "bench" / "data" / "instructions.jsonl"
HOLDOUT_EVERY = 8  # prompt 0, 8, 16, ... are held out


@dataclass(frozen=True)
class SampleSettings:
    """What determines the samples; a resumed run must ask for the same."""

    num_samples: int
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int


@dataclass(frozen=True)
class Sample:
    prompt_index: int
    token_ids: list[int]  # prompt + answer
    prompt_len: int


class Rows:
    """Padded training rows and their loss masks."""

    def __init__(self, token_ids: torch.Tensor, loss_mask: torch.Tensor) -> None:
        self.token_ids = token_ids  # [num_rows, seq_len] int64
        self.loss_mask = loss_mask  # [num_rows, seq_len] bool: position t predicts token t+1

    def __len__(self) -> int:
        return self.token_ids.shape[0]

    def batch(self, rows: list[int]) -> "Rows":
        return Rows(self.token_ids[rows], self.loss_mask[rows])

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())


def load_instruction_prompts(path: Path = INSTRUCTIONS_PATH) -> list[str]:
    with open(path) as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def generate_samples(target: str, prompts: list[str], settings: SampleSettings, **engine_overrides) -> list[Sample]:
    """Sample ``settings.num_samples`` answers from the target, batched, seeded per request."""
    if not prompts:
        raise ValueError("distillation needs at least one prompt")
    llm = LLM(model=target, **engine_overrides)
    texts = [user_prompt_text(llm.tokenizer, p) for p in prompts]
    which = [i % len(prompts) for i in range(settings.num_samples)]
    params = [
        SamplingParams(max_tokens=settings.max_new_tokens, temperature=settings.temperature,
                       top_p=settings.top_p, seed=settings.seed + i)
        for i in range(settings.num_samples)
    ]
    outputs = llm.generate([texts[j] for j in which], params, use_tqdm=True)
    llm.engine.worker.close()
    return [
        Sample(j, list(out.prompt_token_ids) + list(out.outputs[0].token_ids), len(out.prompt_token_ids))
        for j, out in zip(which, outputs)
    ]


def load_or_generate(path: Path, target: str, prompts: list[str], settings: SampleSettings,
                     **engine_overrides) -> list[Sample]:
    """Samples from ``path`` if it was made with ``settings``, else generate and write them."""
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved["settings"] != asdict(settings):
            raise ValueError(f"{path} holds samples made with {saved['settings']}, not {asdict(settings)}; "
                             "use the same settings to resume, or another output folder")
        return [Sample(**s) for s in saved["samples"]]
    samples = generate_samples(target, prompts, settings, **engine_overrides)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"settings": asdict(settings), "samples": [asdict(s) for s in samples]}))
    os.replace(tmp, path)
    return samples


def split_rows(samples: list[Sample], seq_len: int, pad_id: int) -> tuple[Rows, Rows]:
    """(train, held-out) rows; the loss covers the answer tokens only (the prompt is given)."""
    train = [s for s in samples if s.prompt_index % HOLDOUT_EVERY != 0]
    held = [s for s in samples if s.prompt_index % HOLDOUT_EVERY == 0]
    if not train:
        raise ValueError(f"no training rows: every prompt index of {len(samples)} samples is held out "
                         f"(every {HOLDOUT_EVERY}th prompt is); give more prompts or samples")
    return _rows(train, seq_len, pad_id), _rows(held, seq_len, pad_id)


def _rows(samples: list[Sample], seq_len: int, pad_id: int) -> Rows:
    seq_len = min(seq_len, max((len(s.token_ids) for s in samples), default=1))  # no all-padding columns
    token_ids = torch.full((len(samples), seq_len), pad_id, dtype=torch.int64)
    loss_mask = torch.zeros((len(samples), seq_len), dtype=torch.bool)
    for r, s in enumerate(samples):
        ids = s.token_ids[:seq_len]
        token_ids[r, : len(ids)] = torch.tensor(ids)
        # Position t predicts token t+1: from the last prompt token to the second-to-last token.
        loss_mask[r, max(s.prompt_len - 1, 0) : len(ids) - 1] = True
    return Rows(token_ids, loss_mask)
