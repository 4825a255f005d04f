"""Batch -> tensors -> logits -> sampled tokens, for one model and its paged KV cache.

The runner owns everything with a tensor in it: the model and the preallocated K/V pool.
The scheduler's block ids index the pool.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from cluster.models.lora import LoRABatch, LoRAState
from cluster.quant.kv_int8 import Int8KVCache, bytes_per_vector
from cluster.runner.attention_choice import AttentionPlan
from cluster.runner.decode_graphs import DecodeGraphs
from cluster.runner.input_batch import SHORT_QUERY_MAX, SeqChunk, prepare_inputs
from cluster.runner.random_stream import SeedKey
from cluster.runner.host_copy import to_device
from cluster.runner.sampler import (
    LogprobsTensors, Sampler, SamplingMetadata, compute_probs, gather_logprobs, greedy_token_ids,
)
from cluster.runner.rejection import greedy_verify, read_verified, verify_drafts
from cluster.runner.synthetic_acceptance import SyntheticAcceptance
from cluster.runner.step_read import first_logprobs, read_step
from cluster.shared.draft_proposal import DraftProposal
from cluster.shared.sampled import PositionLogprobs, PromptLogprobs, SampledTokens
from cluster.shared.scheduled import ScheduledRequest


# Prompt rows whose logprobs are taken in one pass (bounds the [rows, vocab] float32 copies).
_PROMPT_LOGPROBS_ROWS = 512


class StepResult(NamedTuple):
    """What one step's forward pass produced."""

    sampled: dict[str, SampledTokens]  # per request that reached the end of its tokens
    prompt_logprobs: dict[str, PromptLogprobs]  # per request that asked for them and ran prompt tokens
    # With a draft head attached (``model.aux_layer_ids``), per request: the position of its chunk's
    # first token and the target's aux states of every token the chunk computed, [n, aux width].
    aux_hidden: dict[str, tuple[int, torch.Tensor]] = {}


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # the compute dtype
    cache_dtype: torch.dtype | None = None  # torch.int8: quantized K/V (cluster.quant.kv_int8); None: dtype

    @property
    def bytes_per_block(self) -> int:
        if self.cache_dtype == torch.int8:
            vector = bytes_per_vector(self.head_dim)
        else:
            vector = self.head_dim * torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * vector


def free_device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def num_blocks_for_budget(spec: KVCacheSpec, budget_bytes: int) -> int:
    num_blocks = budget_bytes // spec.bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"a KV budget of {budget_bytes} bytes holds no block of {spec.bytes_per_block} bytes; "
            "raise cache.kv_cache_memory"
        )
    return int(num_blocks)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, spec: KVCacheSpec, device: torch.device,
                 batch_invariant: bool = False, verification: str = "auto", seeded_race: bool = False,
                 attention: AttentionPlan = AttentionPlan(), lora: LoRAState | None = None) -> None:
        """``batch_invariant``: every step's attention goes through the compiled kernel, one
        query row at a time (the model must have been loaded for it, see ``load_model``).
        ``verification`` (``speculative.verification``): ``auto`` verifies seeded requests'
        drafts by coupling and the others' by rejection sampling, ``rejection`` all by
        rejection sampling, ``coupled`` all by coupling (unseeded requests get a seed of their
        own, drawn from the default generator when they first sample). ``seeded_race``: seeded
        requests draw by an exponential race on keyed noise instead of the inverse CDF (an engine
        with a draft model: its drafts then couple with the target's tokens far more often).
        ``attention`` (``choose_attention``): the path ``gather`` copies each sequence's context
        out of the cache (plus the CPU kernel), ``flex`` reads it in place through the block
        table, with its decode steps bucketed and (CUDA) replayed from graphs. ``lora``: the
        adapters attached to ``model`` (a chunk's ``lora_slot`` picks one)."""
        if verification not in ("auto", "rejection", "coupled"):
            raise ValueError(f"verification must be auto, rejection or coupled, got {verification!r}")
        self.model = model
        self.lora = lora
        self.short_query_max = None if batch_invariant else SHORT_QUERY_MAX
        self.spec = spec
        self.device = device
        self.num_blocks = num_blocks
        if attention.path not in ("gather", "flex"):
            raise ValueError(f"attention must be gather or flex, got {attention.path!r}")
        self.attention = attention.path
        # CUDA graphs pad decode steps with rows whose K/V go to a scratch block past the pool's.
        cache_blocks = num_blocks + 1 if attention.cuda_graphs else num_blocks
        self.flex = None if attention.path == "gather" else attention.layout(cache_blocks)
        num_slots = cache_blocks * spec.block_size
        if spec.cache_dtype == torch.int8:
            self.kv_caches = Int8KVCache(spec.num_layers, num_slots, spec.num_kv_heads, spec.head_dim,
                                         spec.dtype, device)
        else:  # [num_layers, 2 (K, V), num_slots, num_kv_heads, head_dim]
            self.kv_caches = torch.zeros(
                spec.num_layers, 2, num_slots, spec.num_kv_heads, spec.head_dim, dtype=spec.dtype, device=device
            )
        self.sampler = Sampler()
        self.coupled = verification != "rejection"  # seeded rows are verified by coupling
        self.own_seeds: dict[str, int] | None = {} if verification == "coupled" else None
        self.seeded_race = seeded_race
        # Accept decisions drawn instead of verified (``synthetic_acceptance.py``): set by benchmarks only.
        self.synthetic_acceptance: SyntheticAcceptance | None = None
        self.graphs = None
        if attention.cuda_graphs:
            self.graphs = DecodeGraphs(model, self.kv_caches, self.flex, spec.block_size,
                                       num_blocks * spec.block_size, device, capture=device.type == "cuda",
                                       lora=lora)

    @property
    def wants_aux(self) -> bool:
        return bool(getattr(self.model, "aux_layer_ids", ()))

    def free_request(self, request_id: str) -> None:
        if self.own_seeds is not None:
            self.own_seeds.pop(request_id, None)

    def seed(self, request) -> int | None:
        """The seed a random request draws with: its own, or (``coupled``) one given to it."""
        params = request.sampling_params
        if params.greedy or (params.seed is None and self.own_seeds is None):
            return None
        if params.seed is not None:
            return params.seed
        if request.request_id not in self.own_seeds:
            self.own_seeds[request.request_id] = int(torch.randint(0, 2**62, ()).item())
        return self.own_seeds[request.request_id]

    def sampling_metadata(self, requests: list, vocab_size: int, offsets: list[int] | None = None,
                          token_bitmask: torch.Tensor | None = None) -> SamplingMetadata:
        """Row ``i`` samples output position ``requests[i].num_output_tokens + offsets[i]`` (offset 0 by
        default); ``token_bitmask`` ([rows, words] int32, CPU): the tokens each row may take."""
        offsets = offsets or [0] * len(requests)
        return SamplingMetadata.build(
            params=[r.sampling_params for r in requests],
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=[r.output_token_ids for r in requests],
            seeds=[self.seed(r) for r in requests],
            positions=[r.num_output_tokens + o for r, o in zip(requests, offsets)],
            banned_token_ids=[_banned_ids(r) for r in requests],
            vocab_size=vocab_size,
            device=self.device,
            seeded_race=self.seeded_race,
            token_bitmask=token_bitmask,
        )

    @torch.inference_mode()
    def forward_logits(self, chunks: list[SeqChunk], block_tables: list[list[int]]) -> torch.Tensor:
        """One forward pass; logits at each chunk's last ``num_logits`` positions, in order:
        [total num_logits, vocab_size] float32."""
        inputs = prepare_inputs(chunks, block_tables, self.spec.block_size, self.device, self.short_query_max,
                                self.flex)
        slots = [c.lora_slot for c in chunks] if self.lora is not None else []
        if self.graphs is not None and self.graphs.covers(inputs):  # a bucketed decode or verify step
            token_slots = None
            if any(slots):
                counts = torch.tensor([len(c.token_ids) for c in chunks])
                token_slots = torch.tensor(slots).repeat_interleave(counts).to(self.device)
            hidden = self.graphs.forward(inputs, token_slots)
        else:
            hidden = self._eager_forward(inputs, chunks, slots)
        if inputs.logits_indices.numel() == 0:
            return hidden.new_empty(0, self.model.vocab_size, dtype=torch.float32)
        return self.model.compute_logits(hidden.index_select(0, inputs.logits_indices)).float()

    def _eager_forward(self, inputs, chunks: list[SeqChunk], slots: list[int]) -> torch.Tensor:
        lora = None
        if any(slots):
            lora = LoRABatch.from_token_slots(slots, [len(c.token_ids) for c in chunks], self.device)
        if lora is not None:
            self.lora.batch = lora
        try:
            return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn)
        finally:
            if lora is not None:
                self.lora.batch = None

    @torch.inference_mode()
    def execute(
        self,
        scheduled: list[ScheduledRequest],
        block_tables: list[list[int]],
        drafts: DraftProposal | None = None,
        token_bitmasks: dict[str, torch.Tensor] | None = None,
    ) -> StepResult:
        """Run the step's forward pass and decide the new tokens of every request that
        reached the end of its tokens: one sampled token, or (with drafts) the accepted
        drafts plus one recovered or bonus token. ``token_bitmasks``: per constrained request,
        the tokens allowed at each verified position ([1 + drafts, words] int32, CPU).
        Requests with ``prompt_logprobs`` also get the logprobs of the prompt tokens their
        chunk predicts (raw: the model's log-softmax, before any sampling setting)."""
        if not scheduled:
            return StepResult({}, {})
        draft_ids = drafts.token_ids if drafts is not None else {}
        if self.lora is not None:  # one adapter among base requests is then one run of rows (LoRABatch.run)
            order = sorted(range(len(scheduled)), key=lambda i: self._lora_slot(scheduled[i].request))
            scheduled, block_tables = [scheduled[i] for i in order], [block_tables[i] for i in order]
        chunks, plain, spec = [], [], []
        rows: dict[str, slice] = {}  # per request that samples: its rows of ``logits``
        prompt_rows = []  # (request, its prompt rows of ``logits``, the position its first row predicts)
        offset = 0
        for sched in scheduled:
            request = sched.request
            start = sched.num_computed_tokens
            tokens = request.all_token_ids[start : start + sched.num_new_tokens]
            proposed = draft_ids.get(request.request_id, []) if sched.samples else []
            num_sampled = 1 + len(proposed) if sched.samples else 0
            num_prompt = _num_prompt_rows(request, start, len(tokens))
            # Prompt rows are the chunk's first; they need the logits of every position.
            num_logits = len(tokens) + len(proposed) if num_prompt else num_sampled
            chunks.append(SeqChunk(tokens + proposed, start, num_logits, self._lora_slot(request)))
            if num_prompt:
                prompt_rows.append((request, slice(offset, offset + num_prompt), start + 1))
            if sched.samples:
                rows[request.request_id] = slice(offset + num_logits - num_sampled, offset + num_logits)
                (spec if proposed else plain).append((request, proposed))
            offset += num_logits
        logits = self.forward_logits(chunks, block_tables)
        aux_hidden = self._aux_by_request(scheduled, chunks) if self.wants_aux else {}
        prompt_logprobs = {request.request_id: self._prompt_logprobs(logits[row_slice], request, first)
                           for request, row_slice, first in prompt_rows}
        results: dict[str, SampledTokens] = {}
        if plain:
            index = torch.tensor([rows[r.request_id].start for r, _ in plain], device=logits.device)
            requests = [r for r, _ in plain]
            bitmask = _bitmask_rows(token_bitmasks, requests, [1] * len(requests))
            results.update(self._sample(logits.index_select(0, index), requests, bitmask))
        if spec:
            bitmask = _bitmask_rows(token_bitmasks, [r for r, _ in spec], [len(d) + 1 for _, d in spec])
            results.update(self._verify(logits, rows, spec, drafts, bitmask))
        return StepResult(results, prompt_logprobs, aux_hidden)

    def _aux_by_request(self, scheduled: list[ScheduledRequest], chunks: list[SeqChunk]):
        aux = self.model.aux_hidden  # [num_tokens, width], the chunks' tokens in order
        out, offset = {}, 0
        for sched, chunk in zip(scheduled, chunks):
            n = len(chunk.token_ids)
            out[sched.request.request_id] = (chunk.start, aux[offset : offset + n])
            offset += n
        return out

    def _lora_slot(self, request) -> int:
        name = getattr(request, "lora_name", None)
        return 0 if name is None or self.lora is None else self.lora.slots[name]

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, request, first: int) -> PromptLogprobs:
        """logits: [n, vocab], the rows predicting prompt positions ``first .. first + n - 1``."""
        num = request.sampling_params.prompt_logprobs
        targets = torch.tensor(request.prompt_token_ids[first : first + logits.shape[0]], device=logits.device)
        entries: list[PositionLogprobs] = []
        for lo in range(0, logits.shape[0], _PROMPT_LOGPROBS_ROWS):
            part = gather_logprobs(logits[lo : lo + _PROMPT_LOGPROBS_ROWS].float().log_softmax(dim=-1),
                                   targets[lo : lo + _PROMPT_LOGPROBS_ROWS], num)
            ids, values, ranks = part.token_ids.tolist(), part.logprobs.tolist(), part.sampled_rank.tolist()
            entries.extend(zip(ids, values, ranks))
        return PromptLogprobs(first, entries)

    def _sample(self, logits: torch.Tensor, requests: list,
                token_bitmask: torch.Tensor | None = None) -> dict[str, SampledTokens]:
        """logits: [num_reqs, vocab_size], one row per request."""
        out = self.sampler(logits, self.sampling_metadata(requests, logits.shape[-1], None, token_bitmask))
        read = read_step(out.sampled_token_ids, out.logprobs)
        results = {}
        for i, request in enumerate(requests):
            num = request.sampling_params.logprobs
            logprobs = None
            if num is not None and read.logprobs is not None:
                logprobs = [first_logprobs(read.logprobs[i], num)]
            results[request.request_id] = SampledTokens([read.tokens[i]], logprobs, 0)
        return results

    def _verify(
        self, logits: torch.Tensor, rows: dict[str, slice], spec: list, drafts: DraftProposal,
        token_bitmask: torch.Tensor | None = None,
    ) -> dict[str, SampledTokens]:
        """Verify the drafts of ``spec`` requests against the target's logits. A request that asks
        for logprobs gets, for every token it emits (accepted drafts, then the recovered or bonus
        token), what plain decoding gives at that position: the logprob, rank and top-n under the
        raw distribution of the target's row there (``Sampler``: the log-softmax of the logits)."""
        requests = [r for r, _ in spec]
        draft_ids = [d for _, d in spec]
        vocab = logits.shape[-1]
        # The target's logits at every verified position, request after request: [sum (k_i + 1), vocab]
        expanded = [r for r, d in spec for _ in range(len(d) + 1)]
        offsets = [j for _, d in spec for j in range(len(d) + 1)]
        flat = torch.cat([logits[rows[r.request_id]] for r in requests])
        metadata = self.sampling_metadata(expanded, vocab, offsets, token_bitmask)
        if metadata.all_greedy or self.synthetic_acceptance is not None:  # compare drafts with the argmax
            target_argmax = greedy_token_ids(flat, metadata)  # [sum (k_i + 1)]: each position's token
            read = read_step(target_argmax, _emitted_logprobs(flat, target_argmax, expanded, metadata))
            out = (greedy_verify(draft_ids, read.tokens) if self.synthetic_acceptance is None
                   else self.synthetic_acceptance.verify(draft_ids, read.tokens))  # a timing rig's
        else:
            flat_probs = compute_probs(flat, metadata)  # [sum (k_i + 1), vocab], request after request
            draft_probs = None if drafts.probs is None else torch.cat([drafts.probs[r.request_id] for r in requests])
            greedy = torch.tensor([r.sampling_params.greedy for r in requests])  # on the host: verify_drafts reads it
            seeded = {i: SeedKey(seed, r.num_output_tokens) for i, r in enumerate(requests)
                      if (seed := self.seed(r)) is not None}
            verified = verify_drafts(draft_ids, draft_probs, flat_probs, greedy, seeded, self.coupled,
                                     self.seeded_race)
            emitted = None
            if metadata.max_num_logprobs is not None:  # the token each verified position emits (where it emits one)
                request_rows = [i for i, (_, d) in enumerate(spec) for _ in range(len(d) + 1)]
                emitted = verified.output[to_device(request_rows, torch.int64, flat.device),
                                          to_device(offsets, torch.int64, flat.device)]  # [sum (k_i + 1)]
            read = read_step(verified.packed(), _emitted_logprobs(flat, emitted, expanded, metadata))
            out = read_verified(read.tokens)
        results, lp_row = {}, 0
        for r, drafted, tokens, accepted in zip(requests, draft_ids, out.output_token_ids, out.num_accepted):
            num, logprobs = r.sampling_params.logprobs, None
            if num is not None:  # its rows of ``read.logprobs``: one per verified position, the first len(tokens) emitted
                logprobs = [first_logprobs(entry, num) for entry in read.logprobs[lp_row : lp_row + len(tokens)]]
                lp_row += len(drafted) + 1
            results[r.request_id] = SampledTokens(tokens, logprobs, accepted)
        return results


def _emitted_logprobs(
    flat_logits: torch.Tensor,  # [sum (k_i + 1), vocab_size] float32: the verified positions, request after request
    emitted: torch.Tensor | None,  # [sum (k_i + 1)] int64: the token each position emits (any id past the last)
    expanded: list,  # the request of each row
    metadata: SamplingMetadata,
) -> LogprobsTensors | None:
    """The logprobs of the emitted tokens, at the rows of the requests that ask for them (in order),
    as ``Sampler`` computes them: raw (the rows' log-softmax), at the step's widest top-n."""
    if metadata.max_num_logprobs is None:
        return None
    wanted = [i for i, r in enumerate(expanded) if r.sampling_params.logprobs is not None]
    if len(wanted) < len(expanded):
        index = to_device(wanted, torch.int64, flat_logits.device)
        flat_logits, emitted = flat_logits.index_select(0, index), emitted.index_select(0, index)
    return gather_logprobs(flat_logits.float().log_softmax(dim=-1), emitted, metadata.max_num_logprobs)


def _num_prompt_rows(request, start: int, num_tokens: int) -> int:
    """How many of a chunk's positions (``start`` on) predict a prompt token whose logprob the
    request asks for: position ``p`` predicts token ``p + 1``, up to the prompt's last."""
    if request.sampling_params.prompt_logprobs is None:
        return 0
    return max(0, min(start + num_tokens, request.num_prompt_tokens - 1) - start)


def _bitmask_rows(token_bitmasks: dict[str, torch.Tensor] | None, requests: list,
                  num_rows: list[int]) -> torch.Tensor | None:
    """The bitmask rows of ``requests`` in order (``num_rows[i]`` each; all ones where a request is
    unconstrained): [sum num_rows, words] int32, or None when none of them is constrained."""
    if not token_bitmasks or not any(r.request_id in token_bitmasks for r in requests):
        return None
    words = next(iter(token_bitmasks.values())).shape[1]
    parts = [token_bitmasks[r.request_id][:n] if r.request_id in token_bitmasks
             else torch.full((n, words), -1, dtype=torch.int32) for r, n in zip(requests, num_rows)]
    return torch.cat(parts)


def _banned_ids(request) -> list[int]:
    """EOS and stop token ids may not be sampled before ``min_tokens`` outputs; a token that
    would complete a bad word never."""
    params = request.sampling_params
    banned = request.bad_word_bans() if request.bad_words_token_ids else []
    if request.num_output_tokens < params.min_tokens:
        banned += params.stop_token_ids
        if request.eos_token_id is not None:
            banned.append(request.eos_token_id)
    return banned
