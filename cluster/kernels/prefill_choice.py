"""Whether prompts' attention runs in the compiled prefill kernel (``prefill_attention.cpp``) here.

torch's SDPA (its CPU flash kernel) ran every prefill before; the kernel of this package replaced
it where it measured faster: on a 2-core Zen 4 EPYC (AVX-512-BF16, no AMX) the whole model's
prefill 1.07-1.74x (docs/cpu.md, from docs/records/prefill-zen4.json). Where torch's kernel has faster arithmetic than the kernel's (AMX, whose
tiles torch's bfloat16 GEMMs can use) that may turn around, so the choice is measured once per
process and attention shape: one causal prompt of ``_PROBE_TOKENS`` tokens both ways (about 30 ms),
the kernel taken where it is the faster. ``TANDEM_PREFILL_KERNEL=0`` keeps SDPA (A/B runs), as does
``TANDEM_CPU_KERNELS=0``.
"""

from __future__ import annotations

import functools
import logging
import os
from types import ModuleType

import torch
import torch.nn.functional as F

from cluster.kernels.build import prefill_attention
from cluster.kernels.float32_gemm import best_pass_seconds

logger = logging.getLogger(__name__)

_PROBE_TOKENS = 512
_PROBE_ROUNDS = 3


@functools.lru_cache(maxsize=None)
def prefill_kernel_for(num_heads: int, num_kv_heads: int, head_dim: int) -> ModuleType | None:
    """The compiled prefill attention for bfloat16 layers of this shape, or None where SDPA stays:
    the kernel cannot run here (no AVX-512, head_dim not a multiple of 64), it was turned off, or
    the probe found SDPA as fast."""
    if os.environ.get("TANDEM_PREFILL_KERNEL", "1") == "0":
        logger.info("prefill attention: SDPA (TANDEM_PREFILL_KERNEL=0)")
        return None
    if head_dim % 64 or num_heads % num_kv_heads:
        return None
    kernel = prefill_attention()
    if kernel is None:
        return None
    sdpa_s, kernel_s = _probe(kernel, num_heads, num_kv_heads, head_dim)
    chosen = kernel if kernel_s < sdpa_s else None
    logger.info("prefill attention (%d heads on %d KV heads, head_dim %d), %d tokens: SDPA %.2f ms, kernel %.2f ms; "
                "using %s", num_heads, num_kv_heads, head_dim, _PROBE_TOKENS, sdpa_s * 1e3, kernel_s * 1e3,
                "SDPA" if chosen is None else "the kernel")
    return chosen


def _probe(kernel: ModuleType, num_heads: int, num_kv_heads: int, head_dim: int) -> list[float]:
    """Best seconds of SDPA (gathered context, causal, as PagedAttention calls it) and of the kernel."""
    generator = torch.Generator().manual_seed(0)
    tokens, scale = _PROBE_TOKENS, head_dim ** -0.5
    cache = torch.randn(2, tokens, num_kv_heads, head_dim, generator=generator).to(torch.bfloat16)
    q = torch.randn(tokens, num_heads * head_dim, generator=generator).to(torch.bfloat16)
    slots = torch.randperm(tokens, generator=generator).view(1, tokens)
    lens = torch.tensor([tokens])

    def sdpa():
        keys = cache[0].index_select(0, slots[0]).view(1, tokens, num_kv_heads, head_dim).transpose(1, 2)
        values = cache[1].index_select(0, slots[0]).view(1, tokens, num_kv_heads, head_dim).transpose(1, 2)
        queries = q.view(1, tokens, num_heads, head_dim).transpose(1, 2)
        return F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale,
                                              enable_gqa=num_heads != num_kv_heads)

    return best_pass_seconds(
        [sdpa, lambda: kernel.paged_prefill_attention(q, cache, slots, lens, lens, num_heads, scale)], _PROBE_ROUNDS)
