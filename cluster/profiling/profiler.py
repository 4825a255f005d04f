"""``tandem profile``: measure a target/draft pair on the device at hand, fit the latency
model, and write the speculation profile (the table of best k per batch size, read from the
measured grid: :meth:`SpeculationProfile.best_k`).

Step times are measured on synthetic batches through the engine's own runners:
``b`` sequences with ``context_len`` tokens of context each (their K/V is whatever the
cache holds: attention costs the same), each computing ``k + 1`` new tokens with logits
at every one of them, exactly as a verification pass does. Acceptance is measured by
generating a prompt set (the calibration prompts, or ``--acceptance-prompts edit``:
:mod:`cluster.profiling.calibration`) with speculation at the largest ``k``, over the
positions asked for (effective acceptance), with the coverage beside it (the share of
positions asked for that got a draft token: below 1 for n-gram lookup).
"""

from __future__ import annotations

import platform
import statistics
import time

import torch
from tqdm import tqdm

from cluster.engine.engine import Engine
from cluster.engine.llm import apply_chat_template
from cluster.shared.sampling_params import SamplingParams
from cluster.kv.block_manager import cdiv
from cluster.runner.input_batch import SeqChunk
from cluster.runner.model_runner import ModelRunner
from cluster.runner.synthetic_acceptance import SyntheticAcceptance
from cluster.profiling.calibration import CALIBRATION_PROMPTS, acceptance_prompts
from cluster.spec_decode.controller import FixedController
from cluster.spec_decode.draft_proposer import DraftModelProposer
from cluster.spec_decode.eagle3_proposer import Eagle3Proposer
from cluster.spec_decode.latency_model import LatencyModel, power_of_two_sizes  # noqa: F401 (re-exported)
from cluster.spec_decode.profile_data import SpeculationProfile
from cluster.spec_decode.suffix import SuffixProposer

_PROFILE_PREFIX = "__profile-"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu: {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


class SyntheticBatch:
    """Block tables for ``b`` fake sequences, taken from the engine's pool and given back."""

    def __init__(self, engine: Engine, batch_size: int, num_tokens: int) -> None:
        self.engine = engine
        self.ids = [f"{_PROFILE_PREFIX}{batch_size}-{i}" for i in range(batch_size)]  # batches coexist
        for rid in self.ids:
            if not engine.block_manager.allocate_slots(rid, 0, num_tokens):
                self.close()
                raise ValueError(f"the KV cache cannot hold {batch_size} x {num_tokens} tokens for profiling")
        self.tables = [engine.block_manager.get_block_table(rid) for rid in self.ids]

    def close(self) -> None:
        for rid in self.ids:
            self.engine.block_manager.free(rid)


def time_interleaved(fns: list, repeats: int, bar=None) -> list[float]:
    """The median seconds of each of ``fns`` over ``repeats`` rounds, each round calling every
    one once in turn (after one warm-up call each). Taking the samples of a cell back to back
    let one slow spell on a shared machine (another process, a frequency dip) inflate every
    sample of the cells it overlapped: in one bench paper run the batch-4 row read 2x its true
    cost from 2 tokens per request on, and its table said k = 0 there (44% slower than the best).
    ``bar`` (tqdm) advances by one per round, warm-up included."""
    for fn in fns:
        fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        if bar is not None:
            bar.update(1)
        for fn, cell in zip(fns, samples):
            started = time.perf_counter()
            fn()
            cell.append(time.perf_counter() - started)
    if bar is not None:
        bar.update(1)
    return [statistics.median(cell) for cell in samples]


def measure_acceptance(engine: Engine, k: int, max_tokens: int = 64) -> list[float]:
    """Effective acceptance per draft position on the calibration prompts at length ``k``."""
    return measure_drafting(engine, k, max_tokens)[0]


def measure_drafting(engine: Engine, k: int, max_tokens: int = 64,
                     prompts: list[str] = CALIBRATION_PROMPTS) -> tuple[list[float], list[float]]:
    """(effective acceptance, coverage) per draft position on ``prompts`` (user messages),
    generated greedily at length ``k``; each list has ``k`` entries (positions never
    reached reuse the last measured value)."""
    saved, saved_stats = engine.controller, engine.spec_stats
    engine.controller = FixedController(k)
    engine.spec_stats = type(saved_stats)()
    try:
        tokenizer = engine.tokenizer
        params = SamplingParams(max_tokens=max_tokens, temperature=0)
        for prompt in prompts:
            text = prompt
            if tokenizer is not None and getattr(tokenizer, "chat_template", None):
                text = apply_chat_template(tokenizer, [{"role": "user", "content": prompt}])
            engine.add_request(text if tokenizer is not None else list(range(3, 40)), params)
        while engine.has_unfinished():
            engine.step()
        rates, coverage = engine.spec_stats.effective_acceptance, engine.spec_stats.coverage
    finally:
        engine.controller, engine.spec_stats = saved, saved_stats
    return _pad(rates, k, 0.0), _pad(coverage, k, 1.0)


def _pad(values: list[float], k: int, empty: float) -> list[float]:
    return (values + [values[-1] if values else empty] * k)[:k]


def run_profile(
    engine: Engine,
    batch_sizes: list[int],
    max_k: int,
    context_len: int = 128,
    repeats: int = 3,
    prompt_set: str = "calibration",
) -> SpeculationProfile:
    if engine.proposer is None:
        raise ValueError("profiling needs speculation on: set speculative.method to 'ngram', 'draft' or 'eagle3'")
    prompts = acceptance_prompts(prompt_set)
    runner = engine.worker.runner
    vocab = runner.model.vocab_size
    gen = torch.Generator().manual_seed(0)
    target_grid: list[tuple[int, int, float]] = []
    draft_grid: list[tuple[int, float]] = []
    groups = _batch_groups(engine, list(dict.fromkeys(batch_sizes)), context_len + max_k + 1)
    with tqdm(total=len(groups) * (repeats + 1) + 1, desc="profiling") as bar:
        for group in groups:
            batches: dict[int, SyntheticBatch] = {}
            try:
                for b in group:
                    batches[b] = SyntheticBatch(engine, b, context_len + max_k + 1)
                cells, fns, draft_passes = [], [], {}
                for b, batch in batches.items():
                    for k in range(max_k + 1):
                        tokens = torch.randint(3, vocab, (b, k + 1), generator=gen).tolist()
                        chunks = [SeqChunk(t, context_len, k + 1) for t in tokens]
                        cells.append((b, k + 1))
                        fns.append(lambda chunks=chunks, tables=batch.tables: runner.forward_logits(chunks, tables))
                    cells.append((b, None))
                    fn, draft_passes[b] = _draft_pass(engine, batch.tables, b, context_len, max_k, vocab, gen)
                    fns.append(fn)
                for (b, n), seconds in zip(cells, time_interleaved(fns, repeats, bar)):
                    if n is None:
                        draft_grid.append((b, seconds / draft_passes[b]))
                    else:
                        target_grid.append((b, n, seconds))
            finally:
                for batch in batches.values():
                    batch.close()
        acceptance, coverage = measure_drafting(engine, max_k, prompts=prompts)
        bar.update(1)
    model = LatencyModel.fit(target_grid, draft_grid)
    errors = [abs(model.target_time(b, n) - t) / t for b, n, t in target_grid]
    profile = SpeculationProfile(
        device=device_name(runner.device),
        target_model=engine.config.model.model,
        draft=_draft_name(engine.config.speculative),
        dtype=str(runner.spec.dtype).removeprefix("torch."),  # the concrete dtype ("auto" resolved)
        tensor_parallel_size=engine.config.parallel.tensor_parallel_size,
        max_k=max_k,
        batch_sizes=batch_sizes,
        target_grid=target_grid,
        draft_grid=draft_grid,
        acceptance=acceptance,
        coverage=coverage,
        acceptance_prompts=prompt_set,
        target_coef=model.target_coef,
        draft_coef=model.draft_coef,
        table={},
        fit_error=sum(errors) / len(errors),
    )
    return profile.model_copy(update={"table": {b: profile.best_k(b) for b in batch_sizes}})


def _draft_pass(engine: Engine, tables, b: int, context_len: int, max_k: int, vocab: int, gen):
    """A call to time for ``b`` sequences' drafting and the draft passes it makes: one draft
    model or head pass, or (n-gram, suffix) a whole proposal of ``max_k`` tokens, counted as ``max_k`` passes."""
    proposer = engine.proposer
    if isinstance(proposer, DraftModelProposer):
        tokens = torch.randint(3, vocab, (b,), generator=gen).tolist()
        chunks = [SeqChunk([t], context_len, 1) for t in tokens]
        return (lambda: proposer.runner.forward_logits(chunks, tables)), 1
    if isinstance(proposer, Eagle3Proposer):
        tokens = torch.randint(3, vocab, (b,), generator=gen).tolist()
        chunks = [SeqChunk([t], context_len, 1) for t in tokens]
        hidden = torch.randn(b, proposer.head.config.hidden_size, generator=gen).to(proposer.kv_cache)
        return (lambda: proposer.draft_pass(chunks, tables, hidden)[1].argmax(-1).tolist()), 1
    sequences = torch.randint(3, vocab, (b, context_len), generator=gen).tolist()
    if isinstance(proposer, SuffixProposer):
        return proposer.timing_call(sequences, max_k), max(1, max_k)
    ngram = proposer.ngram
    return (lambda: ngram.propose(sequences, [max_k] * b)), max(1, max_k)


def _batch_groups(engine: Engine, batch_sizes: list[int], num_tokens: int) -> list[list[int]]:
    """Every batch size in one group (timed interleaved) when the KV cache holds them all at
    once, else one group per batch size."""
    blocks = engine.block_manager
    needed = sum(batch_sizes) * cdiv(num_tokens, blocks.block_size)
    return [list(batch_sizes)] if needed <= blocks.num_free_blocks else [[b] for b in batch_sizes]


def _draft_name(speculative) -> str:
    """The draft model, or the method where no model drafts (n-gram, with its cap on short
    matches when one is set: it changes the coverage and acceptance measured)."""
    if speculative.method in ("draft", "eagle3") and speculative.draft_model:
        return speculative.draft_model
    cap = speculative.ngram_draft_per_match_token
    if speculative.method == "ngram" and cap is not None:
        return f"ngram, short matches draft <= {cap:g} per matched token"
    return speculative.method


def set_synthetic_acceptance(engine: Engine, alphas: str | None) -> SyntheticAcceptance | None:
    """Timing rigs only (``tandem profile`` and ``tandem bench paper``): accept drafts as drawn
    from ``alphas`` (``SyntheticAcceptance.parse``) instead of verifying them. None leaves the
    engine as it is."""
    if not alphas:
        return None
    runner = engine.worker.runner
    if not isinstance(runner, ModelRunner):
        raise ValueError("synthetic acceptance is set on the engine's own runner: run without tensor parallelism")
    runner.synthetic_acceptance = SyntheticAcceptance.parse(alphas)
    return runner.synthetic_acceptance

