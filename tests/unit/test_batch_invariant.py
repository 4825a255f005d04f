"""``model.batch_invariant``: a token's numbers do not depend on what else shares its step."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from cluster.backends.vllm_args import vllm_settings
from cluster.config import ConfigError, TandemConfig, with_overrides
from cluster.shared.sampling_params import SamplingParams
from cluster.kernels import build
from cluster.kernels.packed_linear import PackedLinear
from cluster.models.tiny import save_tiny_model, tiny_llama_config
from cluster.runner.input_batch import SeqChunk, prepare_inputs
from tests.engine_helpers import make_engine, run_to_completion


@pytest.fixture(scope="module")
def kernels():
    if build.small_gemm() is None or build.decode_ops() is None:
        # Where the CPU has the vectors the kernels need, failing to build them is a bug, not a skip.
        assert not build.cpu_has_vectors() or not build.kernels_enabled(), "the CPU kernels did not build here"
        pytest.skip("the compiled CPU kernels are not available on this CPU")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_alone_and_among_many(kernels, dtype):
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(64, 96, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(96, 64, generator=gen))
        linear.bias.copy_(torch.randn(96, generator=gen))
    layer = PackedLinear(linear.to(dtype), batch_invariant=True)
    x = torch.randn(150, 64, generator=gen).to(dtype)  # more rows than one kernel call takes
    together = layer(x)
    for i in (0, 5, 63, 64, 100, 149):
        assert torch.equal(layer(x[i:i + 1])[0], together[i]), i
    for start, stop in ((0, 9), (3, 70), (60, 150)):
        assert torch.equal(layer(x[start:stop]), together[start:stop])


def test_only_batch_invariant_inputs_give_long_chunks_their_own_contexts():
    chunks = [SeqChunk(list(range(3, 43)), 0, 1), SeqChunk([7], 20, 1)]
    tables = [[0, 1, 2], [3, 4]]
    usual = prepare_inputs(chunks, tables, 16, torch.device("cpu"))
    assert usual.attn.row_context_lens is None  # 40 query tokens: the SDPA path
    every = prepare_inputs(chunks, tables, 16, torch.device("cpu"), short_query_max=None)
    assert every.attn.row_context_lens.tolist() == list(range(1, 41)) + [21]
    assert every.attn.row_context_slots.shape == (41, 40)
    # Row 39 (position 39) of the first sequence sees slots 0..39; the decode row sees its 21.
    assert every.attn.row_context_slots[39].tolist() == list(range(40))
    assert every.attn.row_context_slots[40, :21].tolist() == list(range(48, 64)) + list(range(64, 69))


def _prompts(seed=0, lengths=(5, 17, 30, 3, 44, 9)):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]


def _run_staggered(engine, prompts, params) -> tuple[dict[int, object], int]:
    """Add the prompts two at a time, a few steps apart, so prefill chunks share steps with
    other requests' decode rows; returns the outputs by prompt index and the number of such
    mixed steps."""
    ids, done, mixed = {}, {}, 0
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        if pending and (not engine.has_unfinished() or len(ids) % 2 == 0 or engine.scheduler.num_running >= 2):
            for _ in range(min(2, len(pending))):
                i, prompt = pending.pop(0)
                ids[engine.add_request(prompt, params)] = i
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = out.outputs[0]
        if engine.last_step.num_prefill_tokens and engine.last_step.num_seqs > 1:
            mixed += 1
        engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.pool.num_blocks
    return done, mixed


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logprobs_alone_equal_logprobs_in_a_mixed_batch(kernels, tiny_llama_dir, dtype):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    engine = make_engine(tiny_llama_dir, num_blocks=128, dtype=dtype, batch_invariant=True)
    prompts = _prompts()
    alone = [_run_staggered(engine, [p], params)[0][0] for p in prompts]
    together, mixed = _run_staggered(engine, prompts, params)
    assert mixed > 0  # the batched run really put prefill and decode rows in one step
    for i, solo in enumerate(alone):
        assert together[i].token_ids == solo.token_ids, i
        assert len(solo.logprobs) == len(solo.token_ids)
        assert together[i].logprobs == solo.logprobs, i  # float equality: the same bits, not close


def test_speculation_keeps_greedy_output_identical_at_any_batch(kernels, tiny_llama_dir):
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [p * 3 for p in _prompts(seed=1, lengths=(4, 6, 3, 5, 7, 4, 6, 5))]  # repeats: lookup proposes
    plain = run_to_completion(make_engine(tiny_llama_dir, num_blocks=256, dtype="bfloat16", batch_invariant=True,
                                          max_num_seqs=8), prompts, greedy)
    for k in (2, 5):
        engine = make_engine(tiny_llama_dir, num_blocks=256, dtype="bfloat16", batch_invariant=True,
                             max_num_seqs=8, method="ngram", num_speculative_tokens=k)
        assert run_to_completion(engine, prompts, greedy) == plain
        spec = engine.stats().spec
        assert spec.num_accepted_tokens > 0


@pytest.mark.parametrize("key, value", [("quantization", "int8"), ("kv_cache_dtype", "int8"),
                                        ("tensor_parallel_size", 2)])
def test_settings_it_cannot_honour_are_refused_by_name(key, value):
    with pytest.raises(ConfigError, match="batch_invariant.*" + key):
        with_overrides(TandemConfig(), batch_invariant=True, **{key: value})


def test_the_vllm_backend_refuses_it():
    config = with_overrides(TandemConfig(), batch_invariant=True)
    with pytest.raises(ValueError, match="VLLM_BATCH_INVARIANT"):
        vllm_settings(config, 1, "/models/x", None, None, False)


def test_a_layer_the_kernel_cannot_take_is_refused(kernels, tmp_path):
    save_tiny_model(tiny_llama_config(hidden_size=40, intermediate_size=80), tmp_path, seed=0)  # 40: not 16k
    with pytest.raises(ValueError, match="batch_invariant.*in_features"):
        make_engine(tmp_path, num_blocks=64, batch_invariant=True)
    make_engine(tmp_path, num_blocks=64)  # the usual mode serves it through torch
