"""Tensor parallelism (TP=2 over gloo on the CPU) computes what one rank computes.

Each TP=2 engine spawns one worker process (about 8 s on this machine), so the tests
share engines where they can and close every engine they start.
"""

from __future__ import annotations

import random

import pytest
import torch

from cluster.engine.sampling_params import SamplingParams
from cluster.models.tiny import save_tiny_model, save_tiny_tokenizer, tiny_llama_config
from cluster.runner.input_batch import SeqChunk
from tests.engine_helpers import make_engine, run_to_completion

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
# One torch thread per rank: the machine has 2 cores and the driver and worker share them.
ENGINE = dict(num_blocks=96, block_size=8, dtype="float32", num_threads=1)
# Float32 logits of TP=2 vs TP=1: the sums run in another order (partial products
# all-reduced), so they agree to rounding, not bit for bit. Measured: at most 3e-6 apart
# for logits up to 5 in magnitude; the bound leaves room for other CPUs' kernels.
LOGITS_TOL = dict(rtol=1e-5, atol=5e-5)


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_llama_kv1_dir(tmp_path_factory):
    """4 query heads over a single KV head: with TP=2 the KV head is replicated."""
    path = tmp_path_factory.mktemp("tiny_llama_kv1")
    save_tiny_model(tiny_llama_config(num_key_value_heads=1), path, seed=3)
    save_tiny_tokenizer(path)
    return path


def _prompts(seed: int = 0, lengths=(5, 19, 33, 3)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]


def _generate(model_dir, **overrides) -> tuple[list[list[int]], object]:
    engine = make_engine(model_dir, **ENGINE, **overrides)
    try:
        return run_to_completion(engine, _prompts(), GREEDY), engine.stats()
    finally:
        engine.worker.close()


SETUPS = {
    "plain": {},
    "chunked-prefill": dict(max_num_batched_tokens=16),
    "draft": dict(method="draft", num_speculative_tokens=3),  # draft_model: the target itself
    "ngram": dict(method="ngram", num_speculative_tokens=2),
}
CASES = [("llama", "plain"), ("llama", "draft"), ("llama", "chunked-prefill"), ("opt", "plain"),
         ("opt", "draft"), ("opt", "ngram"), ("llama-kv1", "plain")]


@pytest.mark.parametrize("family,setup", CASES, ids=[f"{f}-{s}" for f, s in CASES])
def test_tp2_greedy_tokens_equal_tp1(family, setup, tiny_llama_dir, tiny_opt_dir, tiny_llama_kv1_dir):
    model_dir = {"llama": tiny_llama_dir, "opt": tiny_opt_dir, "llama-kv1": tiny_llama_kv1_dir}[family]
    overrides = dict(SETUPS[setup])
    if overrides.get("method") == "draft":
        overrides["draft_model"] = str(model_dir)
    expected, _ = _generate(model_dir)
    got, stats = _generate(model_dir, tensor_parallel_size=2, **overrides)
    assert got == expected
    if "method" in overrides:
        assert stats.spec.num_draft_tokens > 0


def _forward_logits(engine) -> torch.Tensor:  # [total num_logits, vocab_size]
    """Logits of a prefill chunk and a two-sequence batch, written to unused blocks of a
    fresh engine (nothing has run, so no cached block is overwritten)."""
    prompts = _prompts(seed=5, lengths=(21, 9))
    chunks = [SeqChunk(prompts[0], 0, 21), SeqChunk(prompts[1], 0, 3)]
    return engine.worker.runner.forward_logits(chunks, [[0, 1, 2], [3, 4]])


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_tp2_logits_close_to_tp1(family, tiny_llama_dir, tiny_opt_dir):
    model_dir = {"llama": tiny_llama_dir, "opt": tiny_opt_dir}[family]
    single = make_engine(model_dir, **ENGINE)
    expected = _forward_logits(single)
    engine = make_engine(model_dir, tensor_parallel_size=2, **ENGINE)
    try:
        got = _forward_logits(engine)
        # The driver holds half of every split layer.
        layer = engine.worker.runner.model.layers[0]
        assert layer.qkv_proj.out_features == single.worker.runner.model.layers[0].qkv_proj.out_features // 2
        assert engine.worker.runner.spec.num_kv_heads == single.worker.runner.spec.num_kv_heads // 2
    finally:
        engine.worker.close()
    assert got.shape == expected.shape == (24, engine.vocab_size)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, **LOGITS_TOL)
