"""Which compute dtype a setting resolves to."""

from __future__ import annotations

import types

import pytest
import torch

from cluster.kernels.packed_linear import can_pack, onednn_packs
from cluster.models.registry import resolve_dtype

CPU = torch.device("cpu")


def _hf(dtype):
    return types.SimpleNamespace(dtype=dtype)


def test_auto_on_the_cpu_is_bfloat16_only_where_onednn_computes_it_natively():
    native = onednn_packs(torch.bfloat16)
    expected = torch.bfloat16 if native else torch.float32
    for checkpoint in ("float32", "bfloat16", torch.float16, None):
        assert resolve_dtype("auto", _hf(checkpoint), CPU) == expected
    # The packed path is only taken where the probe says oneDNN runs it.
    assert can_pack(CPU, torch.bfloat16) == (native and torch.backends.mkldnn.is_available())


def test_explicit_dtypes_are_kept_and_float16_is_refused_on_the_cpu():
    assert resolve_dtype("float32", _hf("bfloat16"), CPU) == torch.float32
    assert resolve_dtype("bfloat16", _hf("float32"), CPU) == torch.bfloat16
    with pytest.raises(ValueError, match="float16 is not supported on the CPU"):
        resolve_dtype("float16", _hf("float32"), CPU)
    with pytest.raises(ValueError, match="not supported; use one of"):
        resolve_dtype("int4", _hf("float32"), CPU)
