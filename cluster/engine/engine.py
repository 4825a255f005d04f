"""The engine: requests in, one scheduled model step at a time, outputs out.

``Engine.step`` is the whole loop: schedule, run the model, update the queues, turn
new tokens into outputs. Checking input (``input_processor``) and building outputs
(``output_processor``) are their own modules. It is synchronous and single-threaded; the engine core
(``cluster/hosting/core.py``) is the one host that steps it in a server.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from cluster.config import TandemConfig
from cluster.engine.grammars import Grammars
from cluster.engine.input_processor import InputProcessor
from cluster.engine.lora_adapters import LoRAAdapters
from cluster.engine.output_processor import OutputProcessor
from cluster.engine.scheduler import Scheduler
from cluster.engine.stats import EngineStats
from cluster.kv.block_manager import BlockManager
from cluster.kv.prefix_cache import engine_hash_seed
from cluster.runner.start import start_worker
from cluster.runner.worker import Worker
from cluster.shared.outputs import RequestOutput
from cluster.shared.sampled import SampledTokens
from cluster.shared.request import Request, RequestStatus
from cluster.shared.sampling_params import SamplingParams
from cluster.spec_decode.controller import BatchState, StepObservation
from cluster.spec_decode.factory import build_speculation, lookahead_depth
from cluster.spec_decode.lookahead import LookaheadDrafts
from cluster.spec_decode.stats import SpecDecodeStats
from cluster.spec_decode.suffix import SuffixProposer

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
        self.proposer, self.controller = build_speculation(config, self.worker)
        depth = lookahead_depth(config, self.proposer, self.controller)
        self.lookahead = LookaheadDrafts(self.proposer, depth) if depth else None
        self.spec_stats = SpecDecodeStats()
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_id)
        self.inputs = InputProcessor(config, self.tokenizer, self.vocab_size, self.eos_token_id, self.max_model_len,
                                     self.block_manager, self.grammars, self.adapters, self._id_in_use)
        self.outputs = OutputProcessor(self.tokenizer)
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
        """Validate and tokenize (``input_processor``); raises ValueError saying what is wrong."""
        return self.inputs.make_request(prompt, sampling_params, request_id, cache_salt, lora)

    def _id_in_use(self, request_id: str) -> bool:
        return request_id in self.scheduler.requests or any(r.request_id == request_id for r, _ in self.adapters.waiting)

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
        self.outputs.add(request, cumulative)
        return request.request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks; unknown or finished ids are ignored."""
        self.adapters.drop(request_id)
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self.worker.runner.free_request(request_id)
        self._free_drafts(request_id)
        self.outputs.drop(request_id)

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
        if self.lookahead is not None:
            drafts = self.lookahead.propose(out.scheduled, tables, self.scheduler.num_draft_tokens)
        elif any(s.num_draft_tokens for s in out.scheduled):
            drafts = self.proposer.propose(out.scheduled, tables)
        drafts, masks = self.grammars.prepare(out.scheduled, drafts)
        executing = time.perf_counter()
        result = self.worker.runner.execute(out.scheduled, tables, drafts, masks)
        execute_seconds = time.perf_counter() - executing
        sampled = result.sampled
        if result.aux_hidden:
            self.proposer.record(result.aux_hidden)
        if result.prompt_logprobs:
            self.outputs.add_prompt_logprobs(result.prompt_logprobs)
        self.scheduler.update(out, sampled)
        if self.lookahead is not None:
            self.lookahead.score([s.request for s in out.scheduled])
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
                    s.request.spec_decode = s.request.spec_decode.add_step(s.num_draft_tokens, proposed, accepted)
                    verified.append((s.num_draft_tokens, proposed, accepted))
        # Steps with prefill chunks are not what the latency model describes (drafts scored
        # past k wait for the next step that is observed).
        if out.scheduled and all(s.num_new_tokens == 1 for s in out.scheduled):
            learnt = verified if self.lookahead is None else self.lookahead.take()
            self.controller.observe(StepObservation(len(out.scheduled), k, seconds, learnt,
                                                    sum(p for _, p, _ in verified)))

    def _output(self, request: Request, sampled: SampledTokens) -> RequestOutput:
        """The request's output after this step; a stop string it completed finishes it here."""
        stop = self.outputs.find_stop(request)
        if stop is not None:
            request.stop_reason = stop
            if not request.is_finished:
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            else:
                request.status = RequestStatus.FINISHED_STOPPED
        output = self.outputs.build(request, sampled)
        if output.finished:
            self.worker.runner.free_request(request.request_id)
            self._free_drafts(request.request_id)
        return output

    def _free_drafts(self, request_id: str) -> None:
        if self.proposer is not None:
            self.proposer.free(request_id)
        if self.lookahead is not None:
            self.lookahead.free(request_id)

    def suffix_history(self, max_requests: int) -> list[list[int]]:
        """The latest finished responses a suffix proposer keeps for another replica's warm start,
        oldest first ([] with another method)."""
        return self.proposer.history(max_requests) if isinstance(self.proposer, SuffixProposer) else []

    def seed_suffix(self, responses: list[list[int]]) -> int:
        """Take another replica's responses into the suffix trees; how many went in (0 with another method)."""
        return self.proposer.seed(responses) if isinstance(self.proposer, SuffixProposer) else 0

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
