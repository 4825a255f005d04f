"""Input processing: a prompt and its sampling parameters checked against what the engine can
serve, and made a ``Request``. Every refusal is a ``ValueError`` (a ``ParamError`` naming the
offending OpenAI parameter where there is one) that says what was wrong."""

from __future__ import annotations

import itertools
from typing import Callable

from cluster.config import TandemConfig
from cluster.engine.bad_words import bad_word_token_ids
from cluster.engine.grammars import Grammars
from cluster.engine.lora_adapters import LoRAAdapters
from cluster.errors import ParamError, require_unicode
from cluster.kv.block_manager import BlockManager, cdiv
from cluster.shared.request import Request
from cluster.shared.sampling_params import SamplingParams, check_priority


class InputProcessor:
    def __init__(self, config: TandemConfig, tokenizer, vocab_size: int, eos_token_id: int | None,
                 max_model_len: int, block_manager: BlockManager, grammars: Grammars, adapters: LoRAAdapters,
                 id_in_use: Callable[[str], bool]) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.block_manager = block_manager
        self.grammars = grammars
        self.adapters = adapters
        self._id_in_use = id_in_use
        self._ids = itertools.count()

    def make_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> Request:
        """Validate and tokenize; raises ValueError saying what is wrong with the input. ``lora``:
        the name of the adapter (``model.lora_modules``, or a folder of ``model.lora_dir``) the
        request runs with."""
        params = sampling_params or SamplingParams()
        prompt_ids, text = self._prompt_ids(prompt)
        self._check_params(params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if self._id_in_use(rid):
            raise ValueError(f"request id {rid!r} is already in use")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ParamError("cache_salt", "cache_salt must be a non-empty string when given")
        check_priority(params, self.config.scheduler.policy)
        self.adapters.resolve(lora)
        request = Request(rid, prompt_ids, params, self.eos_token_id, prompt=text, cache_salt=cache_salt,
                          lora_name=lora)
        if params.bad_words:
            if self.tokenizer is None:
                raise ParamError("bad_words", "bad_words need a tokenizer; this model has none")
            request.bad_words_token_ids = bad_word_token_ids(self.tokenizer, params.bad_words)
        request.grammar = self.grammars.matcher_for(params)
        return request

    def _prompt_ids(self, prompt: str | list[int]) -> tuple[list[int], str | None]:
        """The prompt's token ids (and its text, when given as text), checked to fit."""
        if isinstance(prompt, str):
            if not prompt:
                raise ParamError("prompt", "the prompt is empty; send at least one token")
            if self.tokenizer is None:
                raise ParamError("prompt", "this model has no tokenizer; send prompt token ids")
            require_unicode(prompt, "prompt")
            prompt_ids, text = self.tokenizer.encode(prompt), prompt
        else:
            prompt_ids, text = list(prompt), None
            bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise ParamError("prompt",
                                 f"prompt token ids must be integers in [0, {self.vocab_size}), got {bad[:3]}")
        if not prompt_ids:
            raise ParamError("prompt", "the prompt is empty; send at least one token")
        if len(prompt_ids) >= self.max_model_len:
            raise ParamError(
                "prompt", f"the prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len}, "
                "so prompts may have at most max_model_len - 1 tokens"
            )
        block_size, num_blocks = self.block_manager.block_size, self.block_manager.pool.num_blocks
        if cdiv(len(prompt_ids) + 1, block_size) > num_blocks:
            raise ParamError(
                "prompt", f"the prompt has {len(prompt_ids)} tokens and cannot fit in the KV cache "
                f"({num_blocks} blocks of {block_size})"
            )
        return prompt_ids, text

    def _check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: token ids against the vocabulary, a tokenizer
        for text stops."""
        if params.stop and self.tokenizer is None:
            raise ParamError("stop", "stop strings need a tokenizer; this model has none (use stop_token_ids)")
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise ParamError("stop_token_ids", f"stop_token_ids must be below the vocabulary size {self.vocab_size}")
        if params.allowed_token_ids is not None:
            self._check_allowed_token_ids(params)
        if any(t >= self.vocab_size for t in params.logit_bias):
            raise ParamError("logit_bias", f"logit_bias token ids must be below the vocabulary size {self.vocab_size}")

    def _check_allowed_token_ids(self, params: SamplingParams) -> None:
        """Refuse allowed ids that leave some step nothing to sample (the row would be all -inf)."""
        allowed = set(params.allowed_token_ids)
        if any(t >= self.vocab_size for t in allowed):
            raise ParamError("allowed_token_ids",
                             f"allowed_token_ids must be below the vocabulary size {self.vocab_size}")
        if params.structured_outputs is not None:
            raise ParamError("allowed_token_ids", "allowed_token_ids cannot be combined with a structured output "
                                                  "(response_format, structured_outputs or a forced tool call)")
        if params.min_tokens and allowed <= set(params.stop_token_ids) | {self.eos_token_id}:
            raise ParamError("allowed_token_ids", f"every allowed token ends the output, and min_tokens "
                                                  f"({params.min_tokens}) bans them before that many tokens")
