"""``tandem bench ...``: each benchmark's arguments and run, registered under one ``bench`` command.
(``bench router`` needs Ray and is registered by ``cluster/cli.py`` from ``deployments/``.)"""

from __future__ import annotations

from cluster.bench import compare, lora, offline, paper, prefix, quant, serve, served, spec
from cluster.bench.structured import add_structured_parser

# name, help, the module's argument adder, its run function
_BENCHMARKS = (
    ("offline", "output tok/s at several batch sizes, Tandem vs transformers",
     offline.add_offline_args, offline.run_offline_bench),
    ("prefix", "TTFT and multi-turn chat throughput, prefix cache on vs off",
     prefix.add_prefix_args, prefix.run_prefix_bench),
    ("spec", "tok/s and TPOT per batch size and k, with acceptance; vLLM as a peer",
     spec.add_spec_args, spec.run_spec_bench),
    ("paper", "arXiv 2310.18813 here: TPOT vs k per batch, k policies under traffic",
     paper.add_paper_args, paper.run_paper_bench),
    ("quant", "int8 and 4-bit kernels, quality and tok/s against full precision", quant.add_quant_args, quant.run_quant_bench),
    ("lora", "what LoRA adapters cost: one and several adapters against the base model, vLLM as a peer",
     lora.add_lora_args, lora.run_lora_bench),
    ("serve", "load-test an OpenAI-compatible server (vllm bench serve metrics)",
     serve.add_serve_args, serve.run_serve_bench),
    ("served", "tandem serve against vLLM's server under vLLM's own client, at 2 requests/s and at "
     "saturation, with the offline engine beside", served.add_served_args, served.run_served),
    ("compare", "one workload against Tandem and vLLM (servers, or the native and vLLM groups of one "
     "cluster): ratios", compare.add_compare_args, compare.run_compare),
)


def add_bench_parser(sub):
    """Register ``tandem bench`` and its benchmarks; returns the benchmarks' subparsers."""
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    for name, help_text, add_args, run in _BENCHMARKS:
        parser = bench.add_parser(name, help=help_text)
        add_args(parser)
        parser.set_defaults(func=_exit_zero(run))
    add_structured_parser(bench)
    return bench


def _exit_zero(run):
    """A benchmark's run (which prints and writes its JSON) as a command that exits 0."""
    def command(args) -> int:
        run(args)
        return 0

    return command
