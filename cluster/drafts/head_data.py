"""What a draft head trains on: the target's own answers, its hidden states and its choices.

:func:`generate_texts` has the target (through Tandem's engine, one continuous batch) answer
the made prompts of :mod:`cluster.drafts.head_prompts` in two rounds (open prompts, then edit
tasks over round one's answers), request ``i`` seeded with ``seed + i``, every other one greedy
and the rest sampled at ``temperature``; and, greedily, the held-out prompts of ``tandem bench
spec`` (:mod:`cluster.profiling.edit_prompts`), which only measure. :func:`extract_features`
then runs the target (``transformers``' model, the reference) once over every text and keeps,
per position, the residual stream entering the head's aux layers and the target's greedy
next token: the head's inputs and labels. Both are saved once and read back on a resumed run.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from cluster.drafts.checkpoint import load_state, save_state
from cluster.drafts.head_prompts import edit_prompts, open_prompts
from cluster.engine.llm import LLM, user_prompt_text
from cluster.profiling.edit_prompts import PASSAGES, TASKS
from cluster.shared.sampling_params import SamplingParams


@dataclass(frozen=True)
class TextSettings:
    """What determines the texts; a resumed run must ask for the same."""

    num_open: int  # round-one prompts; round two edits half of their answers
    max_new_tokens: int
    temperature: float
    seed: int


@dataclass(frozen=True)
class Text:
    token_ids: list[int]  # prompt + answer
    prompt_len: int


@dataclass
class Texts:
    train: list[Text]
    held_out: list[Text]


def held_out_prompts() -> list[str]:
    """``tandem bench spec``'s own prompts: every task over every passage."""
    return [f"{task}\n\n{passage}" for passage in PASSAGES for task in TASKS]


def generate_texts(target: str, settings: TextSettings, progress: bool = True, **engine_overrides) -> Texts:
    llm = LLM(model=target, **engine_overrides)
    try:
        opened = _answer(llm, open_prompts(settings.num_open, settings.seed), settings, 0, progress)
        passages = [llm.tokenizer.decode(t.token_ids[t.prompt_len:], skip_special_tokens=True)
                    for t in opened[: settings.num_open // 2]]
        edited = _answer(llm, edit_prompts(passages, settings.seed), settings, settings.num_open, progress)
        held = _answer(llm, held_out_prompts(), TextSettings(0, settings.max_new_tokens, 0.0, 0), 0, progress)
    finally:
        llm.engine.worker.close()
    return Texts(opened + edited, held)


def _answer(llm: LLM, prompts: list[str], settings: TextSettings, first_index: int, progress: bool) -> list[Text]:
    params = []
    for i in range(len(prompts)):
        index = first_index + i
        temperature = 0.0 if index % 2 == 0 else settings.temperature
        params.append(SamplingParams(max_tokens=settings.max_new_tokens, temperature=temperature,
                                     seed=settings.seed + index if temperature > 0 else None))
    texts = [user_prompt_text(llm.tokenizer, p) for p in prompts]
    outputs = llm.generate(texts, params, use_tqdm=progress)
    return [Text(list(o.prompt_token_ids) + list(o.outputs[0].token_ids), len(o.prompt_token_ids))
            for o in outputs]


def load_or_generate_texts(path: Path, target: str, settings: TextSettings, progress: bool = True,
                           **engine_overrides) -> Texts:
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved["settings"] != asdict(settings):
            raise ValueError(f"{path} holds texts made with {saved['settings']}, not {asdict(settings)}; "
                             "use the same settings to resume, or another output folder")
        return Texts([Text(**t) for t in saved["train"]], [Text(**t) for t in saved["held_out"]])
    texts = generate_texts(target, settings, progress, **engine_overrides)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"settings": asdict(settings), "train": [asdict(t) for t in texts.train],
                               "held_out": [asdict(t) for t in texts.held_out]}))
    os.replace(tmp, path)
    return texts


@dataclass
class Features:
    """Per text: ``aux`` [len, len(aux_layers) * hidden] (bfloat16) and ``labels`` [len] (the target's
    greedy choice after each position, int64)."""

    aux: list[torch.Tensor]
    labels: list[torch.Tensor]


@torch.inference_mode()
def extract_features(model, texts: list[Text], aux_layers: tuple[int, ...], desc: str | None,
                     batch_size: int = 8) -> Features:
    """``model``: a ``transformers`` causal LM (its ``hidden_states[i]`` is the stream entering layer i);
    ``desc``: the progress bar's title (None: no bar). Texts of like length run ``batch_size`` at a
    time, right-padded (a causal model's states at a text's own positions ignore what follows):
    2.5x the texts a second of one at a time on a 2-core CPU."""
    aux: list[torch.Tensor | None] = [None] * len(texts)
    labels: list[torch.Tensor | None] = [None] * len(texts)
    order = sorted(range(len(texts)), key=lambda i: len(texts[i].token_ids))
    bar = tqdm(total=len(texts), desc=desc, unit="text", disable=desc is None)
    for lo in range(0, len(order), batch_size):
        batch = order[lo : lo + batch_size]
        lengths = [len(texts[i].token_ids) for i in batch]
        ids = torch.zeros(len(batch), max(lengths), dtype=torch.int64)
        mask = torch.zeros(len(batch), max(lengths), dtype=torch.int64)
        for row, (i, n) in enumerate(zip(batch, lengths)):
            ids[row, :n] = torch.tensor(texts[i].token_ids)
            mask[row, :n] = 1
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        stream = torch.cat([out.hidden_states[i] for i in aux_layers], dim=-1)
        chosen = out.logits.argmax(dim=-1)
        for row, (i, n) in enumerate(zip(batch, lengths)):
            aux[i] = stream[row, :n].to(torch.bfloat16).clone()
            labels[i] = chosen[row, :n].clone()
        bar.update(len(batch))
    bar.close()
    return Features(aux, labels)


def load_or_extract(path: Path, model, texts: list[Text], aux_layers: tuple[int, ...],
                    desc: str | None) -> Features:
    saved = load_state(path)
    if saved is not None and saved["aux_layers"] == list(aux_layers) and saved["num_texts"] == len(texts):
        return Features(saved["aux"], saved["labels"])
    features = extract_features(model, texts, aux_layers, desc)
    save_state(path, aux_layers=list(aux_layers), num_texts=len(texts), aux=features.aux, labels=features.labels)
    return features
