"""The engine: requests in, one scheduled model step at a time, outputs out.

``Engine.step`` is the whole loop: schedule, run the model, update the queues, turn
new tokens into outputs. It is synchronous and single-threaded; ``AsyncEngine`` runs
it off the event loop.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

from cluster.config import TandemConfig
from cluster.engine.bad_words import bad_word_token_ids
from cluster.engine.detokenizer import IncrementalDetokenizer
from cluster.engine.grammars import Grammars
from cluster.engine.lora_adapters import LoRAAdapters
from cluster.engine.scheduler import Scheduler
from cluster.engine.stats import EngineStats
from cluster.errors import ParamError, require_unicode
from cluster.kv.block_manager import BlockManager, cdiv
from cluster.kv.prefix_cache import engine_hash_seed
from cluster.runner.model_runner import PromptLogprobs, SampledTokens
from cluster.runner.start import start_worker
from cluster.runner.worker import Worker
from cluster.shared.outputs import CompletionOutput, Logprob, RequestOutput, RequestTimes, TokenLogprobs, Usage
from cluster.shared.request import Request, RequestStatus
from cluster.shared.sampling_params import SamplingParams, check_priority
from cluster.spec_decode.controller import BatchState, StepObservation
from cluster.spec_decode.factory import build_speculation
from cluster.spec_decode.stats import SpecDecodeStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepRecord:
    """What the latest step did, for timing it against the batch it ran."""

    num_seqs: int
    k: int
    num_prefill_tokens: int  # scheduled tokens of requests still prefilling (0: a decode-only step)
    seconds: float
    num_tokens: int = 0  # tokens the step computed (prompt chunks, decodes and drafts)
    num_output_tokens: int = 0  # tokens it appended to outputs
    execute_seconds: float = 0.0  # of ``seconds``, the runner's forward pass and sampling


@dataclass
class _OutputState:
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[TokenLogprobs] | None  # so far (None: not asked for, or deltas only)
    num_sent_tokens: int = 0
    cumulative: bool = True
    # Prompt logprobs so far, from the first token's None on (None: not asked for); a delta
    # stream gets them whole with its first output.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False


class Engine:
    def __init__(self, config: TandemConfig, worker: Worker | None = None) -> None:
        self.config = config
        self.worker = worker or start_worker(config)
        self.tokenizer = self.worker.tokenizer
        self.max_model_len = self.worker.max_model_len
        self.block_manager = BlockManager(
            self.worker.runner.num_blocks,
            config.cache.block_size,
            enable_caching=config.cache.enable_prefix_caching,
            hash_seed=_hash_seed(config),
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len)
        self.adapters = LoRAAdapters(config, self.worker.runner.lora, self.worker.runner.model, self.block_manager.pool)
        self.eos_token_id = self.worker.eos_token_id
        self.vocab_size = self.worker.vocab_size
        self._states: dict[str, _OutputState] = {}
        self._ids = itertools.count()
        self.proposer, self.controller = build_speculation(config, self.worker)
        self.spec_stats = SpecDecodeStats()
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_id)
        self.last_step: StepRecord | None = None

    # ---- requests -----------------------------------------------------------------
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
        if isinstance(prompt, str):
            if not prompt:
                raise ParamError("prompt", "the prompt is empty; send at least one token")
            if self.tokenizer is None:
                raise ParamError("prompt", "this model has no tokenizer; send prompt token ids")
            require_unicode(prompt, "prompt")
            prompt_ids = self.tokenizer.encode(prompt)
            text = prompt
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
        block_size = self.block_manager.block_size
        if cdiv(len(prompt_ids) + 1, block_size) > self.block_manager.pool.num_blocks:
            raise ParamError(
                "prompt", f"the prompt has {len(prompt_ids)} tokens and cannot fit in the KV cache "
                f"({self.block_manager.pool.num_blocks} blocks of {block_size})"
            )
        if params.stop and self.tokenizer is None:
            raise ParamError("stop", "stop strings need a tokenizer; this model has none (use stop_token_ids)")
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise ParamError("stop_token_ids", f"stop_token_ids must be below the vocabulary size {self.vocab_size}")
        if params.allowed_token_ids is not None:
            self._check_allowed_token_ids(params)
        if any(t >= self.vocab_size for t in params.logit_bias):
            raise ParamError("logit_bias", f"logit_bias token ids must be below the vocabulary size {self.vocab_size}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.scheduler.requests or any(r.request_id == rid for r, _ in self.adapters.waiting):
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

    def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> str:
        return self.add_prepared(self.make_request(prompt, sampling_params, request_id, cache_salt, lora))

    def add_prepared(self, request: Request, cumulative: bool = True) -> str:
        """Queue a request from ``make_request``. ``cumulative=False``: its outputs carry only
        what each step added (``text``, ``token_ids`` and ``logprobs`` are the deltas), as
        vLLM's ``RequestOutputKind.DELTA`` does, which spares a stream copying its whole output
        at every step. A request whose adapter has no room yet waits in ``adapters``."""
        if self.adapters.add(request, self.scheduler.requests.values()):
            self.scheduler.add_request(request)
        params = request.sampling_params
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.stop,
                                           params.skip_special_tokens, params.min_tokens,
                                           params.include_stop_str_in_output)
        logprobs = [] if params.logprobs is not None and cumulative else None
        prompt_logprobs = [None] if params.prompt_logprobs is not None else None
        self._states[request.request_id] = _OutputState(detok, logprobs, cumulative=cumulative,
                                                        prompt_logprobs=prompt_logprobs)
        return request.request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks; unknown or finished ids are ignored."""
        self.adapters.drop(request_id)
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self.worker.runner.free_request(request_id)
        self._states.pop(request_id, None)

    @property
    def num_waiting(self) -> int:
        """Requests waiting: in the scheduler's queue, or for their adapter to be read or loaded."""
        return self.scheduler.num_waiting + len(self.adapters.waiting) + self.adapters.num_reading

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.adapters.waiting)

    # ---- the loop ---------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        if self.adapters.waiting:
            for request in self.adapters.admit_waiting(list(self.scheduler.requests.values())):
                self.scheduler.add_request(request)
        k = self._choose_k()
        out = self.scheduler.schedule(num_lookahead_tokens=k)
        tables = [self.block_manager.get_block_table(s.request.request_id) for s in out.scheduled]
        drafts = None
        if any(s.num_draft_tokens for s in out.scheduled):
            drafts = self.proposer.propose(out.scheduled, tables)
        drafts, masks = self.grammars.prepare(out.scheduled, drafts)
        executing = time.perf_counter()
        result = self.worker.runner.execute(out.scheduled, tables, drafts, masks)
        execute_seconds = time.perf_counter() - executing
        sampled = result.sampled
        if result.prompt_logprobs:
            self._add_prompt_logprobs(result.prompt_logprobs)
        self.scheduler.update(out, {rid: s.token_ids for rid, s in sampled.items()})
        if masks:
            self.grammars.advance([s.request for s in out.scheduled], self.scheduler)
        seconds = time.perf_counter() - started
        self._record_spec(k, out, drafts, sampled, seconds)
        num_prefill = sum(s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1)
        num_tokens = sum(s.num_new_tokens for s in out.scheduled)
        if drafts is not None:
            num_tokens += sum(len(ids) for ids in drafts.token_ids.values())
        num_output = sum(len(s.token_ids) for s in sampled.values())
        self.last_step = StepRecord(len(out.scheduled), k, num_prefill, seconds, num_tokens, num_output,
                                    execute_seconds)
        return [self._output(s.request, sampled[s.request.request_id]) for s in out.scheduled
                if s.request.request_id in sampled]

    def _choose_k(self) -> int:
        if self.controller is None:
            return 0
        return self.controller.choose_k(BatchState(self.scheduler.num_running, self.scheduler.num_waiting))

    def _record_spec(self, k: int, out, drafts, sampled, seconds: float) -> None:
        if self.controller is None:
            return
        self.spec_stats.record_step(k)
        verified = []  # per request asked for drafts: (asked, proposed, accepted)
        if drafts is not None:
            for s in out.scheduled:
                rid = s.request.request_id
                if s.num_draft_tokens and rid in sampled:
                    proposed = len(drafts.token_ids.get(rid, ()))
                    accepted = sampled[rid].num_accepted if proposed else 0
                    self.spec_stats.record_request(proposed, accepted, s.num_draft_tokens)
                    verified.append((s.num_draft_tokens, proposed, accepted))
        # Steps with prefill chunks are not what the latency model describes.
        if out.scheduled and all(s.num_new_tokens == 1 for s in out.scheduled):
            self.controller.observe(StepObservation(len(out.scheduled), k, seconds, verified,
                                                    sum(p for _, p, _ in verified)))

    def _add_prompt_logprobs(self, computed: dict[str, PromptLogprobs]) -> None:
        """Append what a step computed of requests' prompt logprobs; positions already held
        (a prompt recomputed after a preemption) are skipped."""
        for rid, part in computed.items():
            state = self._states.get(rid)
            if state is None or state.prompt_logprobs is None:
                continue
            skip = len(state.prompt_logprobs) - part.first_position
            if skip >= 0:
                state.prompt_logprobs.extend(self._logprobs(entry) for entry in part.entries[skip:])

    def _output(self, request: Request, sampled: SampledTokens) -> RequestOutput:
        state = self._states[request.request_id]
        new_ids = request.output_token_ids[state.num_sent_tokens :]
        if state.detokenizer is not None:
            # The token that stopped the request (EOS, a stop id) adds no text unless asked to.
            num_texts = len(new_ids)
            if (request.status == RequestStatus.FINISHED_STOPPED and new_ids and request.is_stop_token(new_ids[-1])
                    and not request.sampling_params.include_stop_str_in_output):
                num_texts -= 1
            for j, token in enumerate(new_ids[:num_texts]):
                stop = state.detokenizer.add_token(token)
                if stop is not None:
                    # A stop string ends the output at the token that completed it, even
                    # inside a run of accepted draft tokens.
                    request.truncate_output(state.num_sent_tokens + j + 1)
                    new_ids = new_ids[: j + 1]
                    request.stop_reason = stop
                    if not request.is_finished:
                        self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
                    else:
                        request.status = RequestStatus.FINISHED_STOPPED
                    break
        delta_logprobs = None
        if request.sampling_params.logprobs is not None and sampled.logprobs is not None:
            delta_logprobs = [self._logprobs(entry) for entry in sampled.logprobs]
            if state.logprobs is not None:
                state.logprobs.extend(delta_logprobs)
        state.num_sent_tokens = request.num_output_tokens
        finished = request.is_finished
        if finished:
            self.worker.runner.free_request(request.request_id)
            del self._states[request.request_id]
        detok = state.detokenizer
        delta_text = detok.release(finished) if detok is not None else ""
        if state.cumulative:
            text = detok.released_text if detok is not None else ""
            token_ids = list(request.output_token_ids)
        else:
            text, token_ids = delta_text, new_ids
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=state.logprobs if state.cumulative else delta_logprobs,
            delta_text=delta_text,
            delta_token_ids=new_ids,
            delta_logprobs=delta_logprobs,
        )
        usage = Usage(request.num_prompt_tokens, request.num_output_tokens, request.num_cached_tokens)
        times = RequestTimes(request.arrival_time, request.scheduled_time, request.first_token_time)
        prompt_logprobs = None
        if state.prompt_logprobs is not None and (state.cumulative or not state.prompt_logprobs_sent):
            prompt_logprobs, state.prompt_logprobs_sent = state.prompt_logprobs, True
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, [completion],
                             finished, usage, times, prompt_logprobs)

    def _logprobs(self, entry: tuple[list[int], list[float], int]) -> TokenLogprobs:
        ids, values, rank = entry
        result: TokenLogprobs = {}
        for position, (token, value) in enumerate(zip(ids, values)):
            token_rank = rank if position == 0 else position
            decoded = self.tokenizer.decode([token]) if self.tokenizer is not None else None
            result.setdefault(token, Logprob(value, token_rank, decoded))
        return result

    def stats(self) -> EngineStats:
        bm, sched = self.block_manager, self.scheduler
        return EngineStats(
            num_running=sched.num_running,
            num_waiting=self.num_waiting,
            kv_cache_usage=bm.usage,
            num_preemptions=sched.num_preemptions,
            num_computed_tokens=sched.num_computed_tokens_total,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_cached_blocks=bm.pool.num_cached_blocks,
            spec=self.spec_stats if self.controller is not None else None,
        )

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()


def _hash_seed(config: TandemConfig) -> int:
    return engine_hash_seed(config.model.model, config.model.dtype, config.model.seed)
