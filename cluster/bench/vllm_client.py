"""vLLM's own serving benchmark client (``vllm.benchmarks.serve``), driven for ``tandem bench served``.

Runs in an interpreter that has vLLM (the vLLM tier's environment): ``python -m
cluster.bench.vllm_client --url URL --tokenizer DIR --dataset random|instructions|code|agentic[-long]
--rate R --num-prompts N --output-len L --out JSON``. The workload is the one vLLM's documentation
uses for serving figures: the ``vllm`` backend (completions, streamed), a fixed seed, outputs of
exactly ``--output-len`` tokens (``--ignore-eos``; ``--honor-eos``: at most that many, each ending
where the model ends it), no sampling settings sent (each server's defaults: temperature 1).
``random`` draws ``--input-len``-token prompts; the others are vLLM's ``custom`` dataset (a jsonl
of ``{"prompt": ...}``): ``instructions`` reads Tandem's instruction prompts
(``data/instructions.jsonl``), ``code`` and the agentic sets the file ``tandem bench served`` wrote
(``--dataset-path``; :func:`cluster.bench.workloads.prompt_sets.write_vllm_dataset`), with
``--skip-chat-template`` where its prompts are already rendered. vLLM's client puts any other
custom prompt through the chat template as one user message.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

INSTRUCTIONS = Path(__file__).parent / "data" / "instructions.jsonl"


def client_args(options: argparse.Namespace) -> list[str]:
    """The command line of ``vllm bench serve`` for these options."""
    args = ["--backend", "vllm", "--base-url", options.url, "--model", options.model, "--tokenizer",
            str(options.tokenizer), "--seed", str(options.seed), "--num-prompts", str(options.num_prompts),
            "--request-rate", str(options.rate), "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-filename", str(options.out)]
    if not getattr(options, "honor_eos", False):
        args.append("--ignore-eos")
    if getattr(options, "max_concurrency", None) is not None:
        args += ["--max-concurrency", str(options.max_concurrency)]
    if getattr(options, "temperature", None) is not None:
        args += ["--temperature", str(options.temperature)]
    if getattr(options, "header", None):
        args += ["--header", *options.header]
    if options.dataset == "random":
        args += ["--dataset-name", "random", "--random-input-len", str(options.input_len),
                 "--random-output-len", str(options.output_len)]
    else:
        path = options.dataset_path or (INSTRUCTIONS if options.dataset == "instructions" else None)
        if path is None:
            raise ValueError(f"--dataset {options.dataset} needs --dataset-path (the jsonl tandem bench served writes)")
        args += ["--dataset-name", "custom", "--dataset-path", str(path),
                 "--custom-output-len", str(options.output_len)]
        if options.skip_chat_template:
            args.append("--skip-chat-template")  # vLLM 0.32's name (the custom dataset reads it)
    return args


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.bench.vllm_client")
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--dataset", choices=["random", "instructions", "code", "agentic", "agentic-long"],
                        default="random")
    parser.add_argument("--dataset-path", type=Path, help="the custom dataset's jsonl (default for instructions: "
                                                          "data/instructions.jsonl)")
    parser.add_argument("--skip-chat-template", action="store_true",
                        help="the custom prompts are rendered already: send them as they are")
    parser.add_argument("--rate", default="inf")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--honor-eos", action="store_true",
                        help="outputs end where the model ends them (at most --output-len), not at exactly that many")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-concurrency", type=int, help="requests in flight at most (default: no limit)")
    parser.add_argument("--temperature", type=float, help="sent with every request (default: the server's, 1)")
    parser.add_argument("--header", action="append",
                        help="KEY=VALUE sent with every request (e.g. X-Tandem-Group=vllm)")
    parser.add_argument("--out", type=Path, required=True)
    options = parser.parse_args(argv)
    # here, not at the top: vLLM is optional (the vllm extra); this runs in the vLLM tier's interpreter
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    vllm_parser = FlexibleArgumentParser()
    add_cli_args(vllm_parser)
    result = bench_main(vllm_parser.parse_args(client_args(options)))
    if not options.out.exists():  # older clients return the result without saving it
        options.out.write_text(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
