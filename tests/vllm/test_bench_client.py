"""What ``tandem bench served`` hands vLLM's benchmark client parses with that client's own parser
(``vllm.benchmarks.serve``), for every dataset: a flag vLLM does not know fails a whole cell."""

from __future__ import annotations

import argparse

import pytest

from cluster.bench import vllm_client


def _options(**changes) -> argparse.Namespace:
    options = dict(url="http://127.0.0.1:1", model="m", tokenizer="tok", seed=0, num_prompts=4, rate="2",
                   out="o.json", dataset="random", dataset_path=None, skip_chat_template=False, input_len=8,
                   output_len=16, max_concurrency=None, temperature=None)
    return argparse.Namespace(**{**options, **changes})


def _parse(argv: list[str]) -> argparse.Namespace:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("dataset, skip", [("random", False), ("instructions", False), ("code", False),
                                           ("agentic", True), ("agentic-long", True)])
def test_every_dataset_parses_as_vllm_reads_it(dataset, skip):
    path = None if dataset in ("random", "instructions") else f"/w/{dataset}.jsonl"
    parsed = _parse(vllm_client.client_args(_options(dataset=dataset, dataset_path=path, skip_chat_template=skip,
                                                     max_concurrency=8, temperature=0.0)))
    assert parsed.dataset_name == ("random" if dataset == "random" else "custom")
    assert parsed.skip_chat_template is skip  # agentic prompts are rendered already
    assert parsed.max_concurrency == 8 and parsed.temperature == 0.0 and parsed.ignore_eos
    if dataset != "random":
        assert parsed.custom_output_len == 16


def test_honoured_eos_parses_as_vllm_reads_it():
    parsed = _parse(vllm_client.client_args(_options(dataset="instructions", honor_eos=True)))
    assert not parsed.ignore_eos and parsed.custom_output_len == 16


def test_a_group_header_parses_as_vllm_reads_it():
    parsed = _parse(vllm_client.client_args(_options(header=["X-Tandem-Group=vllm"])))
    assert parsed.header == ["X-Tandem-Group=vllm"]  # vLLM's client splits KEY=VALUE into each request's headers
    assert not getattr(_parse(vllm_client.client_args(_options())), "header", None)
