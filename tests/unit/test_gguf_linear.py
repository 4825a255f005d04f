"""model.quantization: gguf: a tiny Llama written as a GGUF file in every served block format (mixed in one
stacked projection too), converted, and served from its blocks: the layers hold the file's bytes, the logits
stay close to the widened model's, speculation stays exactly plain greedy decoding, bad settings are refused."""

from __future__ import annotations

import random
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize
from transformers import LlamaConfig, LlamaForCausalLM

from cluster.backends.vllm_args import vllm_settings
from cluster.config import TandemConfig, with_overrides
from cluster.bench.quant_quality import sequence_logits
from cluster.kernels.build import gguf_gemm
from cluster.models.gguf_blocks import FORMATS, dequantize_rows, read_blocks
from cluster.models.loader import resolve_model
from cluster.quant.gguf_linear import BlockPart, GGUFLinear
from cluster.runner.worker import Worker
from cluster.shared.sampling_params import SamplingParams
from tests.engine_helpers import make_engine, run_to_completion
from tests.unit.test_gguf_blocks import random_rows
from tests.unit.test_loader import write_tiny_gguf

needs_kernel = pytest.mark.skipif(gguf_gemm() is None, reason="gguf_gemm needs AVX2/AVX-512 and a compiler")

# Every served format, Q/K/V of one layer in two formats (a stacked projection of two parts).
LAYER_FORMATS = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K",
                 "ffn_gate": "Q4_0", "ffn_up": "Q4_1", "ffn_down": "Q8_0"}
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


def _quantized(weight: np.ndarray, name: str, seed: int) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """The weight's blocks: gguf's own quantizer where it has one, else random K-quant blocks of its size."""
    qtype = gguf.GGMLQuantizationType[name]
    if name in ("Q4_0", "Q4_1", "Q8_0"):
        return quantize(weight, qtype), qtype
    raw = random_rows(name, weight.shape[0], weight.shape[1], seed=seed, half_scale=1e-4)
    return raw.numpy(), qtype


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory) -> Path:
    """A converted tiny GGUF model whose linear layers are blocks of every served format."""
    folder = tmp_path_factory.mktemp("gguf")
    model = _tiny_llama()
    seeds = iter(range(100))

    def as_blocks(gguf_name: str, tensor: np.ndarray):
        kind = gguf_name.split(".")[-2]
        fmt = "Q8_0" if kind == "token_embd" else LAYER_FORMATS.get(kind)
        return tensor if fmt is None else _quantized(tensor, fmt, next(seeds))

    write_tiny_gguf(folder / "tiny.gguf", model, transform=as_blocks)
    return folder / "tiny.gguf"


def _worker(model, **overrides) -> Worker:
    return Worker.from_config(with_overrides(TandemConfig(), model=str(model), device="cpu", num_blocks=64,
                                             cache_dir=str(Path(model).parent / "cache"), **overrides))


def _prompts(seed=0, lengths=(5, 17, 30, 3)):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]


def test_the_converted_folder_keeps_the_files_bytes_beside_the_widened_weights(gguf_model):
    source = resolve_model(str(gguf_model), cache_dir=gguf_model.parent / "cache")
    blocks = read_blocks(source.path)
    reader = gguf.GGUFReader(str(gguf_model))
    raw_down = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    down, fmt = blocks["model.layers.1.mlp.down_proj.weight"]
    assert fmt.name == "Q8_0" and torch.equal(down, torch.from_numpy(np.array(raw_down.data)).view(256, -1))
    assert blocks["model.embed_tokens.weight"][1].name == "Q8_0"
    assert {fmt.name for _, fmt in blocks.values()} == set(FORMATS)
    assert "model.norm.weight" not in blocks  # float32 tensors stay in the weights alone


@needs_kernel
def test_layers_compute_from_the_blocks_and_stay_close_to_the_widened_model(gguf_model):
    worker = _worker(gguf_model, quantization="gguf")
    layers = {name: m for name, m in worker.runner.model.named_modules() if isinstance(m, GGUFLinear)}
    assert len(layers) == 2 * 4 + 1  # four projections a layer and the tied head
    assert [f.name for f in layers["layers.0.qkv_proj"].formats] == ["Q4_K", "Q6_K"]
    assert [f.name for f in layers["lm_head"].formats] == ["Q8_0"]
    # the blocks' values are the widened model's weights (Q and K rows un-permuted alike)
    qkv = layers["layers.0.qkv_proj"]
    widened = torch.cat([dequantize_rows(raw, fmt) for raw, fmt in zip(qkv.blocks, qkv.formats)])
    dense = _worker(gguf_model)
    dense_qkv = dict(dense.runner.model.named_modules())["layers.0.qkv_proj"]
    x = torch.randn(3, 256)
    torch.testing.assert_close(dense_qkv(x), x @ widened.T, rtol=1e-4, atol=1e-4)
    ids = _prompts(lengths=(12,))[0]
    exact = sequence_logits(dense, ids)
    # one token at a time: every step takes the blocks (a prompt's many rows take the widened weights)
    served = torch.stack([sequence_logits(worker, ids[:n + 1])[-1] for n in range(len(ids))])
    difference = (served - exact).abs()
    assert 0 < difference.max() < 0.01 * exact.std()  # about 15 bits of each activation: close, yet another path
    one_pass = _worker(gguf_model, quantization="gguf", gguf_activations="int8")
    coarse = torch.stack([sequence_logits(one_pass, ids[:n + 1])[-1] for n in range(len(ids))])
    assert difference.max() < (coarse - exact).abs().max() < 0.1 * exact.std()  # 8 bits: further, still close


@needs_kernel
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculation_on_the_blocks_is_exactly_plain_greedy_decoding(gguf_model, method):
    cache = dict(cache_dir=str(gguf_model.parent / "cache"), num_blocks=128)
    prompts = [p * 3 for p in _prompts(seed=3)]  # repeats for the drafts to find
    plain = run_to_completion(make_engine(gguf_model, quantization="gguf", **cache), prompts, GREEDY)
    engine = make_engine(gguf_model, quantization="gguf", method=method, num_speculative_tokens=4, **cache)
    assert run_to_completion(engine, prompts, GREEDY) == plain
    assert engine.stats().spec.num_draft_tokens > 0


def test_a_model_without_blocks_is_refused_with_what_to_do(tiny_llama_dir):
    with pytest.raises(ValueError, match="has none in a served format.*model.quantization: none"):
        _worker(tiny_llama_dir, quantization="gguf")


def test_bad_parts_are_refused():
    dense = torch.nn.Linear(64, 8, bias=False)
    with pytest.raises(ValueError, match="hold 4 rows, the layer 8"):
        GGUFLinear(dense, [BlockPart(random_rows("Q4_1", 4, 64), FORMATS["Q4_1"])])
    with pytest.raises(ValueError, match="Q8_0 rows of 40 bytes do not hold 64 weights"):
        GGUFLinear(dense, [BlockPart(random_rows("Q4_1", 8, 64), FORMATS["Q8_0"])])


def test_vllm_groups_refuse_gguf_with_a_clear_line():
    with pytest.raises(ValueError, match="vLLM loads a .gguf model itself"):
        vllm_settings(with_overrides(TandemConfig(), backend="vllm", quantization="gguf"), 1, "model", None, None, False)


@needs_kernel
def test_the_blocks_take_at_least_a_k8_verification_and_the_rows_can_be_fixed(gguf_model, monkeypatch):
    probed = _worker(gguf_model, quantization="gguf")
    rows = {m.max_rows for m in probed.runner.model.modules() if isinstance(m, GGUFLinear)}
    assert len(rows) == 1 and rows.pop() in (9, 10, 12, 16, 24, 32, 48, 64)
    monkeypatch.setenv("TANDEM_GGUF_ROWS", "0")  # never the blocks: the widened weights' logits exactly
    off = _worker(gguf_model, quantization="gguf")
    ids = _prompts(lengths=(6,))[0]
    assert torch.equal(sequence_logits(off, ids[:1]), sequence_logits(_worker(gguf_model), ids[:1]))
