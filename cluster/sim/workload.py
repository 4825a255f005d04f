"""The simulated requests: the bench generators' distributions, drawn with numpy.

``tandem bench serve`` builds its workloads request by request in Python
(:mod:`cluster.bench.serve_workload`); a million requests need arrays. The length
ranges (:func:`~cluster.bench.serve_workload.length_range`), the phase and process
checks, the shared-prefix system prompts and the instruction set are taken from that
module, so there is one definition of each dataset; only the random draws differ
(numpy's generator instead of ``random.Random``), so the same seed gives the same
*distribution*, not the same requests:

* arrivals: gaps gamma distributed with shape ``burstiness`` and mean ``1 / rate``, the
  first request at 0; phases restart the process at each boundary (rate 0 is silence).
* random: prompt and output lengths uniform on ``length_range(len, range_ratio)``.
* shared-prefix: request j uses system prompt j mod num_prefixes (then shuffled); its
  prompt is the system prompt's words plus its question's; the system prompt is the
  shared part a prefix cache can reuse.
* instructions: the shipped instructions' word counts, shuffled and cycled.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cluster.bench.serve_workload import (
    Phase,
    check_process,
    length_range,
    load_instructions,
    shared_prefix_requests,
)
from cluster.sim.config import WorkloadConfig


@dataclass(frozen=True)
class Workload:
    """One row per request, sorted by arrival."""

    arrival_s: np.ndarray  # [n] float64, ascending
    prompt_len: np.ndarray  # [n] int64
    output_len: np.ndarray  # [n] int64
    prefix_id: np.ndarray  # [n] int64, -1: no shared prefix
    shared_len: np.ndarray  # [n] int64, tokens of the prompt that are the shared prefix

    @property
    def num_requests(self) -> int:
        return len(self.arrival_s)


def gamma_arrivals(num_requests: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send times from 0: the first at 0, then gamma gaps (shape ``burstiness``, mean 1/rate)."""
    check_process(rate, burstiness)
    if num_requests == 0:
        return np.zeros(0)
    if rate == np.inf:
        return np.zeros(num_requests)
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=num_requests - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def phased_arrivals(phases: list[Phase], burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send times of the phased process; every time lies inside its phase."""
    check_process(1.0, burstiness)
    pieces, start = [], 0.0
    for phase in phases:
        end = start + phase.duration_s
        if phase.rate > 0:
            times = np.zeros(0)
            while True:  # draw gaps in chunks until the phase is over
                expected = int(phase.rate * phase.duration_s * 1.1) + 16
                gaps = rng.gamma(burstiness, 1.0 / (phase.rate * burstiness), size=expected)
                last = times[-1] if len(times) else start
                times = np.concatenate([times, last + np.cumsum(gaps)])
                if times[-1] >= end:
                    break
            pieces.append(times[times < end])
        start = end
    return np.concatenate(pieces) if pieces else np.zeros(0)


def _uniform_lengths(length: int, range_ratio: float, n: int, rng: np.random.Generator) -> np.ndarray:
    low, high = length_range(length, range_ratio, 1)
    return rng.integers(low, high + 1, size=n, dtype=np.int64)


def draw_lengths(config: WorkloadConfig, num_requests: int, seed: int) -> tuple[np.ndarray, ...]:
    """(prompt_len, output_len, prefix_id, shared_len) of ``num_requests`` requests."""
    rng = np.random.default_rng([seed, 1])
    n = num_requests
    no_prefix = np.full(n, -1, dtype=np.int64)
    if config.dataset == "random":
        prompt = _uniform_lengths(config.input_len, config.range_ratio, n, rng)
        output = _uniform_lengths(config.output_len, config.range_ratio, n, rng)
        return prompt, output, no_prefix, np.zeros(n, dtype=np.int64)
    output = np.full(n, config.output_len, dtype=np.int64)
    if config.dataset == "instructions":
        words = np.array([len(p.split()) for p in load_instructions()], dtype=np.int64)
        order = rng.permutation(len(words))
        return words[order][np.arange(n) % len(words)], output, no_prefix, np.zeros(n, dtype=np.int64)
    # shared-prefix: the bench generator's own system prompts and question shape
    sample = shared_prefix_requests(config.num_prefixes, config.num_prefixes, config.prefix_len,
                                    config.question_len, config.output_len, seed)
    system_len = {r.system: len(r.system.split()) for r in sample}
    systems = np.array(sorted(system_len.values()), dtype=np.int64)
    question_len = int(np.mean([len(r.prompt.split()) for r in sample]))
    prefix = rng.permutation(np.arange(n, dtype=np.int64) % config.num_prefixes)
    shared = systems[prefix]
    return shared + question_len, output, prefix, shared


def build_workload(config: WorkloadConfig, seed: int, capacity_rps: float) -> Workload:
    """The requests of ``config``; a ``load`` is a fraction of ``capacity_rps`` (requests/s
    the cluster sustains), so ``load: 0.8`` is 80% of capacity."""
    rng = np.random.default_rng([seed, 0])
    if config.phases is not None:
        phases = [Phase(p.rate if p.rate is not None else p.load * capacity_rps, p.duration_s) for p in config.phases]
        arrivals = phased_arrivals(phases, config.burstiness, rng)
    else:
        rate = config.rate if config.rate is not None else config.load * capacity_rps
        arrivals = gamma_arrivals(config.num_requests, rate, config.burstiness, rng)
    prompt, output, prefix, shared = draw_lengths(config, len(arrivals), seed)
    return Workload(arrivals, prompt, output, prefix, shared)


def mean_lengths(config: WorkloadConfig, seed: int) -> tuple[float, float]:
    """Mean prompt and output lengths of the dataset (from a sample of 4096 requests)."""
    prompt, output, _, shared = draw_lengths(config, 4096, seed)
    return float(prompt.mean()), float(output.mean())
