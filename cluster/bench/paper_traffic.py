"""Open-loop traffic for ``tandem bench paper``: Poisson arrivals driving the engine in real time.

A workload is a list of phases, each a Poisson process of ``rate`` requests per second
that lasts ``num_requests`` arrivals (a uniform workload has one phase). The arrival
times come from a fixed seed, so every policy sees the same trace. The loop adds the
requests whose arrival time has passed, then runs one ``engine.step()``; with nothing to
run it sleeps until the next arrival. A request's latency counts from its scheduled
arrival, so time spent waiting behind a long step counts too (open loop).

Per request: TPOT = (finish - first token) / (output tokens - 1), TTFT = first token -
arrival, latency = finish - arrival. Per run: means of those over requests (and mean TPOT
per phase, requests counted in the phase they arrived in), throughput = output tokens /
(last finish - first arrival), the share of step time spent in steps that carried a
prompt's prefill (the speculation length hardly changes those), and per step the batch
size the controller saw and the ``k`` it chose.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field

from cluster.shared.sampling_params import SamplingParams


@dataclass(frozen=True)
class Phase:
    rate: float  # requests per second
    num_requests: int


@dataclass(frozen=True)
class Workload:
    name: str  # "uniform-1.20" or "phased"
    kind: str  # "uniform" or "phased"
    phases: tuple[Phase, ...]
    arrival_s: tuple[float, ...]  # since the start of the run, ascending

    @property
    def num_requests(self) -> int:
        return len(self.arrival_s)

    def to_json(self) -> dict:
        return {"name": self.name, "kind": self.kind,
                "phases": [{"rate": p.rate, "num_requests": p.num_requests} for p in self.phases],
                "arrival_s": list(self.arrival_s)}


def poisson_arrivals(phases: tuple[Phase, ...], seed: int) -> tuple[float, ...]:
    """Arrival times of a piecewise-constant Poisson process; phase ``i + 1`` starts at the
    last arrival of phase ``i``."""
    rng = random.Random(seed)
    now, times = 0.0, []
    for phase in phases:
        if phase.rate <= 0:
            raise ValueError(f"arrival rates must be > 0 requests/s, got {phase.rate}")
        for _ in range(phase.num_requests):
            now += rng.expovariate(phase.rate)
            times.append(now)
    return tuple(times)


def uniform_workload(rate: float, num_requests: int, seed: int) -> Workload:
    phases = (Phase(rate, num_requests),)
    return Workload(f"uniform-{rate:.2f}", "uniform", phases, poisson_arrivals(phases, seed))


def phased_workload(low: float, high: float, num_requests: int, seed: int) -> Workload:
    """Low, then high, then low again: a quarter, a half and a quarter of the requests."""
    quarter = max(1, num_requests // 4)
    phases = (Phase(low, quarter), Phase(high, max(1, num_requests - 2 * quarter)), Phase(low, quarter))
    return Workload("phased", "phased", phases, poisson_arrivals(phases, seed))


@dataclass(frozen=True)
class StepRecord:
    t_s: float  # when the step started, since the start of the run
    num_running: int  # the batch size the controller saw
    k: int  # the speculation length it chose


@dataclass
class RunResult:
    policy: str
    workload: str
    num_requests: int
    output_tokens: int
    duration_s: float  # first arrival to last finish
    mean_tpot_ms: float
    mean_latency_s: float
    mean_ttft_s: float
    throughput_tok_s: float
    mean_batch_size: float  # over steps
    mean_k: float  # over steps
    k_per_step: dict[int, int]
    acceptance_rate: float | None
    steps: list[StepRecord] = field(default_factory=list)  # kept in the JSON for table and adaptive only
    phase_mean_tpot_ms: list[float] = field(default_factory=list)  # per phase of the workload
    prefill_step_share: float | None = None  # step seconds in steps carrying prefill / all step seconds


def run_open_loop(engine, workload: Workload, prompt_ids: list[list[int]], output_len: int,
                  policy: str) -> RunResult:
    """Serve ``workload`` (request ``i`` gets prompt ``i % len(prompt_ids)``) with the
    engine's current controller. Raises RuntimeError if a request's token count is wrong."""
    if engine.has_unfinished():
        raise RuntimeError("the traffic run needs an idle engine")
    engine.spec_stats = type(engine.spec_stats)()
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    arrival: dict[str, float] = {}
    index: dict[str, int] = {}  # request id -> its place in the arrival trace
    step_seconds = {"prefill": 0.0, "all": 0.0}
    first: dict[str, float] = {}
    finished: dict[str, tuple[float, int]] = {}
    steps: list[StepRecord] = []
    arrivals = workload.arrival_s
    next_req = 0
    start = time.perf_counter()
    while next_req < len(arrivals) or engine.has_unfinished():
        now = time.perf_counter() - start
        while next_req < len(arrivals) and arrivals[next_req] <= now:
            rid = engine.add_request(prompt_ids[next_req % len(prompt_ids)], params)
            arrival[rid], index[rid] = arrivals[next_req], next_req
            next_req += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[next_req] - now))
            continue
        num_running = engine.scheduler.num_running
        outputs = engine.step()
        done = time.perf_counter() - start
        recent = engine.spec_stats.recent_k
        steps.append(StepRecord(now, num_running, recent[-1] if recent else 0))
        step_seconds["all"] += engine.last_step.seconds
        if engine.last_step.num_prefill_tokens:
            step_seconds["prefill"] += engine.last_step.seconds
        for out in outputs:
            if out.outputs[0].delta_token_ids and out.request_id not in first:
                first[out.request_id] = done
            if out.finished:
                finished[out.request_id] = (done, len(out.outputs[0].token_ids))
    result = _summarize(policy, workload, output_len, arrival, first, finished, steps, engine.spec_stats, index)
    result.prefill_step_share = step_seconds["prefill"] / step_seconds["all"] if step_seconds["all"] else None
    return result


def _summarize(policy, workload, output_len, arrival, first, finished, steps, spec_stats, index) -> RunResult:
    wrong = [n for _, n in finished.values() if n != output_len]
    if wrong or len(finished) != workload.num_requests:
        raise RuntimeError(f"{policy} on {workload.name}: {len(finished)} of {workload.num_requests} requests "
                           f"finished, token counts {wrong[:3]} instead of {output_len}")
    tpot = {rid: (end - first[rid]) / (n - 1) for rid, (end, n) in finished.items() if n > 1}
    tpots = list(tpot.values())
    phase_of: list[int] = []  # phase of each place in the arrival trace
    for number, phase in enumerate(workload.phases):
        phase_of += [number] * phase.num_requests
    by_phase = [[t for rid, t in tpot.items() if phase_of[index[rid]] == p] for p in range(len(workload.phases))]
    output_tokens = sum(n for _, n in finished.values())
    duration = max(end for end, _ in finished.values()) - min(arrival.values())
    ks = Counter(s.k for s in steps)
    return RunResult(
        policy=policy, workload=workload.name, num_requests=len(finished), output_tokens=output_tokens,
        duration_s=duration,
        mean_tpot_ms=sum(tpots) / len(tpots) * 1e3 if tpots else 0.0,
        mean_latency_s=sum(end - arrival[rid] for rid, (end, _) in finished.items()) / len(finished),
        mean_ttft_s=sum(first[rid] - arrival[rid] for rid in finished) / len(finished),
        throughput_tok_s=output_tokens / duration,
        mean_batch_size=sum(s.num_running for s in steps) / max(1, len(steps)),
        mean_k=sum(s.k for s in steps) / max(1, len(steps)),
        k_per_step=dict(sorted(ks.items())),
        acceptance_rate=spec_stats.acceptance_rate if spec_stats.num_draft_tokens else None,
        steps=steps,
        phase_mean_tpot_ms=[sum(ts) / len(ts) * 1e3 if ts else 0.0 for ts in by_phase],
    )
