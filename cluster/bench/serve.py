"""``tandem bench serve``: an OpenAI-API load generator with the metrics of ``vllm bench serve``.

Every request is a streamed POST to ``/v1/completions`` (``prompt``) or
``/v1/chat/completions`` (``messages``) with ``max_tokens`` from the dataset,
``stream_options.include_usage`` and, if asked, ``ignore_eos`` (vLLM and Tandem accept
it). Requests leave at the workload's seeded arrival times (see ``serve_workload``);
``max_concurrency`` caps how many are in flight (a late request waits for a slot, and
its latencies count from when it was actually sent, as in vLLM). One aiohttp session
carries everything (its connection pool is not capped below ``max_concurrency``); one
request's stream is parsed and timed in ``serve_client``, where a failed request is
recorded, not raised, so the run goes on. Metrics: ``serve_metrics``; the table and
figures: ``serve_report``.

In-process use: ``await run_serve_benchmark(ServeBenchOptions(...))``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from tqdm import tqdm

from cluster.bench.args import positive_int
from cluster.bench.benchmark import Benchmark
from cluster.bench.serve_client import first_model_id, send_request
from cluster.bench.serve_metrics import (
    DEFAULT_PERCENTILES, SLO_METRICS, RequestRecord, parse_goodput, parse_percentiles, summarize,
)
from cluster.bench.serve_report import print_summary, write_plots
from cluster.bench.serve_workload import (
    DATASETS, BenchRequest, Phase, arrival_times, instruction_requests, parse_phases, phased_arrival_times,
    random_requests, shared_prefix_requests,
)

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class ServeBenchOptions:
    """Everything that defines a run. ``requests``, when given, replaces the dataset; with
    ``phases`` the phases decide the number of requests (the workload is cycled to fit)."""

    url: str = "http://127.0.0.1:8000"
    endpoint: str = "completions"  # or "chat"
    model: str | None = None  # None: the first id of GET /v1/models
    api_key: str | None = None
    dataset: str = "random"
    num_prompts: int = 100
    request_rate: float = math.inf
    burstiness: float = 1.0
    phases: tuple[Phase, ...] = ()
    max_concurrency: int | None = None
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = False
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    num_prefixes: int = 4
    prefix_len: int = 512
    question_len: int = 12
    output_len: int = 128  # shared-prefix and instructions
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    goodput: dict[str, float] = field(default_factory=dict)  # ttft/tpot/e2el -> ms
    num_warmups: int = 0  # untimed requests sent one by one before the run
    timeout_s: float = 6 * 3600.0
    show_progress: bool = True
    requests: tuple[BenchRequest, ...] | None = None
    headers: tuple[tuple[str, str], ...] = ()  # sent with every request, e.g. (("X-Tandem-Group", "vllm"),)

    def validate(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}")
        if self.num_prompts < 1 or (self.max_concurrency is not None and self.max_concurrency < 1):
            raise ValueError("num_prompts and max_concurrency must be >= 1")
        if self.requests is not None and not self.requests:
            raise ValueError("requests, when given, must not be empty")
        if self.num_warmups < 0 or not self.timeout_s > 0:
            raise ValueError("num_warmups must be >= 0 and timeout_s > 0")
        if set(self.goodput) - set(SLO_METRICS) or not all(0 <= p <= 100 for p in self.percentiles):
            raise ValueError(f"goodput keys must be among {', '.join(SLO_METRICS)} and percentiles in [0, 100]; "
                             f"got {sorted(self.goodput)} and {list(self.percentiles)}")

    def to_json(self) -> dict:
        """The options as JSON; the API key is never written out."""
        config = asdict(self)
        config.update(request_rate=str(self.request_rate) if math.isinf(self.request_rate) else self.request_rate,
                      requests="custom" if self.requests is not None else None,
                      api_key="<redacted>" if self.api_key else None)
        return config


@dataclass(frozen=True)
class ServeBenchResult:
    model: str
    options: ServeBenchOptions
    summary: dict
    records: list[RequestRecord]

    def to_json(self) -> dict:
        return {"model": self.model, "config": self.options.to_json(), "summary": self.summary,
                "requests": [r.to_json() for r in self.records]}


def build_workload(options: ServeBenchOptions) -> tuple[list[BenchRequest], tuple[float, ...]]:
    """The requests and their send times (seconds from the start), one each."""
    if options.phases:
        times = phased_arrival_times(options.phases, options.burstiness, options.seed)
        if not times:
            raise ValueError("the phases produce no requests; raise a rate or a duration")
    else:
        times = arrival_times(options.num_prompts, options.request_rate, options.burstiness, options.seed)
    n = len(times)
    if options.requests is not None:
        base = list(options.requests)
    elif options.dataset == "random":
        base = random_requests(n, options.random_input_len, options.random_output_len,
                               options.random_range_ratio, options.seed)
    elif options.dataset == "shared-prefix":
        base = shared_prefix_requests(n, options.num_prefixes, options.prefix_len, options.question_len,
                                      options.output_len, options.seed)
    else:
        base = instruction_requests(n, options.output_len, options.seed)
    return [base[i % len(base)] for i in range(n)], times


def request_body(options: ServeBenchOptions, model: str, request: BenchRequest) -> dict:
    body = {"model": model, "max_tokens": request.output_len, "temperature": options.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if options.endpoint == "chat":
        body["messages"] = request.messages()
    else:
        body["prompt"] = request.completion_prompt()
    if options.ignore_eos:
        body["ignore_eos"] = True
    return body


async def run_serve_benchmark(options: ServeBenchOptions) -> ServeBenchResult:
    """Run the workload against ``options.url`` and summarize it. Raises ValueError for bad
    options or a server that lists no model, RuntimeError if a warm-up request fails."""
    import aiohttp  # here, not at the top: would add ~0.08 s to every tandem command, for this benchmark only

    options.validate()
    requests, times = build_workload(options)
    base = options.url.rstrip("/").removesuffix("/v1")
    url = base + ENDPOINTS[options.endpoint]
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    headers.update(dict(options.headers))
    connector = aiohttp.TCPConnector(limit=options.max_concurrency or 0)
    timeout = aiohttp.ClientTimeout(total=options.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        model = options.model or await first_model_id(session, base)
        for i in range(options.num_warmups):
            req = requests[i % len(requests)]
            warm = await send_request(session, url, request_body(options, model, req), options.endpoint, i, req,
                                      0.0, time.perf_counter())
            if not warm.success:
                raise RuntimeError(f"warm-up request failed: {warm.error}")
        slots = asyncio.Semaphore(options.max_concurrency) if options.max_concurrency else None
        progress = tqdm(total=len(requests), disable=not options.show_progress, desc="requests")

        async def one(i: int, t0: float) -> RequestRecord:
            body = request_body(options, model, requests[i])
            if slots is None:
                record = await send_request(session, url, body, options.endpoint, i, requests[i], times[i], t0)
            else:
                async with slots:
                    record = await send_request(session, url, body, options.endpoint, i, requests[i], times[i], t0)
            progress.update(1)
            return record

        t0 = time.perf_counter()
        tasks = []
        for i, at in enumerate(times):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, t0)))
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
        progress.close()
    summary = summarize(records, duration, options.goodput, options.percentiles)
    return ServeBenchResult(model, options, summary, records)


def options_from_args(args: argparse.Namespace) -> ServeBenchOptions:
    return ServeBenchOptions(
        url=args.url, endpoint=args.endpoint, model=args.model, api_key=args.api_key, dataset=args.dataset,
        num_prompts=args.num_prompts, request_rate=args.request_rate, burstiness=args.burstiness,
        phases=parse_phases(args.phases) if args.phases else (), max_concurrency=args.max_concurrency,
        seed=args.seed, temperature=args.temperature, ignore_eos=args.ignore_eos,
        random_input_len=args.random_input_len, random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio, num_prefixes=args.num_prefixes, prefix_len=args.prefix_len,
        question_len=args.question_len, output_len=args.output_len,
        percentiles=parse_percentiles(args.metric_percentiles), goodput=parse_goodput(args.goodput or []),
        num_warmups=args.num_warmups, timeout_s=args.timeout, show_progress=not args.disable_tqdm,
    )


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--url", default="http://127.0.0.1:8000", help="server base URL (default http://127.0.0.1:8000)")
    add("--endpoint", choices=list(ENDPOINTS), default="completions", help="/v1/completions or /v1/chat/completions")
    add("--model", help="model name to send (default: the first id of GET /v1/models)")
    add("--api-key", help="sent as 'Authorization: Bearer KEY'")
    add("--dataset", choices=DATASETS, default="random")
    add("--num-prompts", type=positive_int, default=100, help="requests to send (ignored with --phases)")
    add("--request-rate", type=float, default=math.inf, help="requests/s; inf (default) sends all at once")
    add("--burstiness", type=float, default=1.0, help="gamma shape of the inter-arrival gaps; 1 = Poisson")
    add("--phases", help="time-varying rate as rate:seconds,... (e.g. 2:30,8:60); overrides --request-rate")
    add("--max-concurrency", type=positive_int, help="most requests in flight at once (default: no cap)")
    add("--seed", type=int, default=0, help="seeds the dataset and the arrivals")
    add("--temperature", type=float, default=0.0)
    add("--ignore-eos", action="store_true", help="send ignore_eos: true (vLLM and Tandem extension)")
    add("--random-input-len", type=positive_int, default=1024, help="random dataset: prompt words (~tokens)")
    add("--random-output-len", type=positive_int, default=128, help="random dataset: max_tokens")
    add("--random-range-ratio", type=float, default=0.0, help="random dataset: lengths vary by +- this ratio")
    add("--num-prefixes", type=positive_int, default=4, help="shared-prefix: distinct system prompts")
    add("--prefix-len", type=positive_int, default=512, help="shared-prefix: words per system prompt")
    add("--question-len", type=positive_int, default=12, help="shared-prefix: random words per question")
    add("--output-len", type=positive_int, default=128, help="shared-prefix and instructions: max_tokens")
    add("--metric-percentiles", default="50,90,99", help="comma list of percentiles to report")
    add("--goodput", nargs="+", metavar="NAME:MS", help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000")
    add("--num-warmups", type=int, default=0, help="untimed requests sent first, one at a time")
    add("--timeout", type=float, default=6 * 3600.0, help="per-request timeout in seconds")
    add("--disable-tqdm", action="store_true", help="no progress bar")


def measure_serve(args: argparse.Namespace, console: Console) -> dict:
    """Send the workload; returns the JSON result (config, summary and every request)."""
    return asyncio.run(run_serve_benchmark(options_from_args(args))).to_json()


SERVE = Benchmark("serve", "load-test an OpenAI-compatible server (vllm bench serve metrics)",
                  add_serve_args, measure_serve, print_summary, plots=write_plots,
                  plots_help="write latency CDF and throughput PNGs into this folder",
                  default_json=Path("bench-serve.json"))
