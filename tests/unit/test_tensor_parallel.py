"""Tensor parallelism (TP=2 over gloo on the CPU) computes what one rank computes.

Each TP=2 engine spawns one worker process (about 8 s on this machine), so the tests
share engines where they can and close every engine they start.
"""

from __future__ import annotations

import random

import pytest
import torch

from cluster.shared.sampling_params import SamplingParams
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


def _fake_group(rank: int, world_size: int):
    """A TPGroup for building and loading a shard in-process (no collective is run)."""
    from cluster.parallel.group import TPGroup

    return TPGroup(rank, world_size, torch.device("cpu"), None, None, None)


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_rank_loads_and_reads_only_its_shard(kv_heads, tiny_llama_dir, tiny_llama_kv1_dir, monkeypatch):
    """Rank 1 of 2 holds the second half of every split weight (with one KV head, a copy of
    it); only the unsplit norms are read whole."""
    from safetensors.torch import load_file

    from cluster.models.hf_folder import LazyTensor, iter_lazy_weights
    from cluster.models.loader import load_hf_config, resolve_model
    from cluster.models.registry import build_model

    model_dir = tiny_llama_dir if kv_heads == 2 else tiny_llama_kv1_dir
    read_whole = []
    full = LazyTensor.full
    monkeypatch.setattr(LazyTensor, "full", lambda self: read_whole.append(self._name) or full(self))
    source = resolve_model(str(model_dir))
    model = build_model(load_hf_config(source), torch.float32, torch.device("cpu"), 64, tp=_fake_group(1, 2))
    model.load_weights(iter_lazy_weights(source))
    assert read_whole and all(name.endswith("norm.weight") for name in read_whole)

    hf = load_file(str(next(model_dir.glob("*.safetensors"))))
    layer, prefix = model.layers[1], "model.layers.1."
    head_dim = 16
    kv_rows = slice(head_dim, 2 * head_dim) if kv_heads == 2 else slice(0, head_dim)
    expected_qkv = torch.cat([hf[prefix + "self_attn.q_proj.weight"][32:64],
                              hf[prefix + "self_attn.k_proj.weight"][kv_rows],
                              hf[prefix + "self_attn.v_proj.weight"][kv_rows]])
    assert torch.equal(layer.qkv_proj.weight, expected_qkv)
    assert torch.equal(layer.o_proj.weight, hf[prefix + "self_attn.o_proj.weight"][:, 32:64])
    assert torch.equal(layer.gate_up_proj.weight, torch.cat([hf[prefix + "mlp.gate_proj.weight"][64:128],
                                                             hf[prefix + "mlp.up_proj.weight"][64:128]]))
    assert torch.equal(layer.down_proj.weight, hf[prefix + "mlp.down_proj.weight"][:, 64:128])
    assert torch.equal(model.embed_tokens.weight, hf["model.embed_tokens.weight"][128:256])
    assert model.lm_head.weight is model.embed_tokens.weight  # tied
    assert (layer.num_heads, layer.num_kv_heads) == (2, 1)


def test_vocab_not_divisible_pads_the_last_shard_with_zero_rows():
    from cluster.parallel.layers import VocabParallelEmbedding

    full = torch.randn(255, 8)
    shards = [VocabParallelEmbedding(255, 8, _fake_group(rank, 2)) for rank in range(2)]
    for shard in shards:
        shard.weight.tp_load(full, None)
    assert torch.equal(torch.cat([s.weight for s in shards])[:255], full)
    assert shards[1].num_real == 127 and not shards[1].weight[127].any()


def test_profile_cli_measures_a_tensor_parallel_engine(tiny_llama_dir, tmp_path):
    import json

    from cluster.cli import main

    out = tmp_path / "profile.json"
    assert main(["profile", "--model", str(tiny_llama_dir), "--device", "cpu", "--dtype", "float32",
                 "--tensor-parallel-size", "2", "--max-k", "1", "--max-batch", "2", "--repeats", "1",
                 "--context-len", "16", "--out", str(out)]) == 0
    profile = json.loads(out.read_text())
    assert profile["tensor_parallel_size"] == 2 and profile["batch_sizes"] == [1, 2]


def _prompt_logprobs(model_dir, **overrides) -> list[list[dict | None]]:
    """Each prompt's prompt_logprobs, its prompts in chunks of at most 16 tokens."""
    engine = make_engine(model_dir, **ENGINE, max_num_batched_tokens=16, **overrides)
    try:
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=2)
        ids = [engine.add_request(p, params) for p in _prompts(seed=7)]
        got = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    got[out.request_id] = out.prompt_logprobs
        return [got[i] for i in ids]
    finally:
        engine.worker.close()


def test_tp2_prompt_logprobs_equal_tp1(tiny_llama_dir):
    """Prompt logprobs need the logits of every prompt position, through the ranks' vocab shards."""
    expected = _prompt_logprobs(tiny_llama_dir)
    got = _prompt_logprobs(tiny_llama_dir, tensor_parallel_size=2)
    for ours, theirs, prompt in zip(got, expected, _prompts(seed=7)):
        assert len(ours) == len(theirs) == len(prompt) and ours[0] is None
        for position in range(1, len(prompt)):
            assert [(t, lp.rank) for t, lp in ours[position].items()] == \
                [(t, lp.rank) for t, lp in theirs[position].items()]
            for token, lp in ours[position].items():
                assert lp.logprob == pytest.approx(theirs[position][token].logprob, abs=1e-4)
