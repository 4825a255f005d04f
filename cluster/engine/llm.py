"""Offline batch generation: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

from typing import Sequence

from tqdm import tqdm

from cluster.config import TandemConfig, with_overrides
from cluster.engine.engine import Engine
from cluster.shared.outputs import RequestOutput
from cluster.shared.sampling_params import SamplingParams


class LLM:
    """All prompts go in at once and continuous batching runs them to completion.

    Settings are a ``TandemConfig`` and/or flat overrides (``dtype="bfloat16"``,
    ``max_num_seqs=8``, ``num_blocks=64``, ...).
    """

    def __init__(self, model: str | None = None, config: TandemConfig | None = None, **overrides) -> None:
        if model is not None:
            overrides["model"] = model
        self.engine = Engine(with_overrides(config or TandemConfig(), **overrides))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``. Every prompt is validated before any runs.
        ``lora``: the adapter (a name of ``model.lora_modules`` or a folder of ``model.lora_dir``) of
        every prompt, or one per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling params")
        adapters = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        if len(adapters) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(adapters)} LoRA adapter names")
        requests = [self.engine.make_request(p, sp, lora=name)
                    for p, sp, name in zip(prompts, sampling_params, adapters)]
        order = {r.request_id: i for i, r in enumerate(requests)}
        for r in requests:
            self.engine.add_prepared(r)
        results: list[RequestOutput | None] = [None] * len(requests)
        progress = None
        if use_tqdm:
            progress = tqdm(total=len(requests), desc="generating")
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished and out.request_id in order:
                    results[order[out.request_id]] = out
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()
        return results

    def chat(
        self, messages: list[list[dict]] | list[dict], sampling_params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [apply_chat_template(self.tokenizer, c) for c in conversations]
        return self.generate(prompts, sampling_params)


def apply_chat_template(tokenizer, messages: list[dict]) -> str:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; send a plain prompt")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def user_prompt_text(tokenizer, prompt: str) -> str:
    """``prompt`` as one user message through the model's chat template, or as it is without one."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return apply_chat_template(tokenizer, [{"role": "user", "content": prompt}])
    return prompt
