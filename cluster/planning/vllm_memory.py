"""What one GPU of a vLLM group holds, where it differs from the native engine.

Read from vLLM 0.32's source (the version the ``vllm`` extra pins), not measured:

- **Weights.** ``engine.vllm_args.quantization: fp8`` quantizes a bfloat16/float16 checkpoint's
  linear layers as it loads them: one byte a weight (plus a scale per tensor). GPUs with FP8
  units (Ada, Hopper) multiply in FP8; older ones (Ampere: A10G, A100) run FP8 Marlin, a
  weight-only kernel. The embedding and the LM head (``ParallelLMHead``, not a linear layer
  there) stay in the model's dtype. Other methods (``awq``, ``gptq``, ...) come with a quantized
  checkpoint whose size is not modelled here: counted in the dtype, an upper bound.
- **The draft** (``speculative_config.method: draft_model``) gets a model config of its own with
  no quantization (vLLM copies the target's only for drafts that live in the target's checkpoint)
  and the target's dtype, and runs tensor-parallel like the target (``draft_tensor_parallel_size``
  defaults to the target's): its weights are split over the ranks, every rank holds a share.
- **KV cache.** ``kv_cache_memory_bytes`` (Tandem's ``cache.kv_cache_memory``, per GPU) is one pool
  shared by every attention layer, the target's and the draft's: all are full attention, so they
  form one KV cache group in which a block holds the same tokens in every layer. Tokens held =
  budget / (target + draft bytes per token). ``vllm_args.kv_cache_dtype: fp8`` stores one byte an
  element. Without a budget, vLLM gives the whole engine ``gpu_memory_utilization`` (0.9) of the
  GPU and the KV cache what is left after its profiling run.
- **Activations.** vLLM measures its own peak in a profiling run at start-up, and its CUDA
  graphs (unless ``enforce_eager``) take a share it also measures; the plan keeps the native
  engine's estimate and says so in a note.
"""

from __future__ import annotations

from cluster.config import TandemConfig
from cluster.planning.model_shapes import ModelShape

# vLLM methods that quantize a full-precision checkpoint at load time to one byte a linear weight.
ONLINE_8BIT_METHODS = frozenset({"fp8"})
FP8_KV_DTYPES = frozenset({"fp8", "fp8_e4m3", "fp8_e5m2"})
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def weight_quantization(config: TandemConfig) -> str:
    """The group's vLLM weight quantization method (``engine.vllm_args.quantization``), or ``none``."""
    return str(config.engine.vllm_args.get("quantization") or "none")


def kv_element_bytes(config: TandemConfig, dtype_bytes: int) -> int:
    """Bytes of one K or V element in vLLM's cache: 1 with an FP8 ``kv_cache_dtype``, else the dtype's."""
    return 1 if str(config.engine.vllm_args.get("kv_cache_dtype", "auto")) in FP8_KV_DTYPES else dtype_bytes


def gpu_memory_utilization(config: TandemConfig) -> float:
    return float(config.engine.vllm_args.get("gpu_memory_utilization", DEFAULT_GPU_MEMORY_UTILIZATION))


def weight_bytes(shape: ModelShape, dtype_bytes: int, method: str, tp: int) -> int:
    """One rank's share of a model's weights under vLLM: linear layers one byte a weight with an
    online 8-bit method, everything else (embedding, LM head, norms) in the dtype; the linear
    layers and the vocabulary split over ``tp`` ranks."""
    head = 0 if shape.tie_word_embeddings else shape.embedding_params
    linear = shape.linear_params - head  # the decoder's linear layers alone
    linear_bytes = linear * (1 if method in ONLINE_8BIT_METHODS else dtype_bytes)
    vocab_bytes = (shape.embedding_params + head) * dtype_bytes
    norms = (2 * shape.num_layers + 1) * shape.hidden_size * dtype_bytes
    return (linear_bytes + vocab_bytes) // tp + norms


def notes(config: TandemConfig, has_draft: bool, dtype: str) -> list[str]:
    """What the plan of a vLLM group takes from vLLM's own behaviour, and what it cannot check."""
    method = weight_quantization(config)
    out = []
    if method != "none" and method not in ONLINE_8BIT_METHODS:
        out.append(f"vLLM quantization {method!r} is not modelled: weights counted in {dtype}, an upper bound")
    draft = ("shared by the target's and the draft's layers, and the draft is split over the ranks like the "
             "target; " if has_draft else "")
    out.append(f"vLLM: the KV budget is one pool per device, {draft}activations are the native engine's estimate "
               "(vLLM measures its own at start-up, on a GPU its CUDA graphs' too: not counted here)")
    return out
