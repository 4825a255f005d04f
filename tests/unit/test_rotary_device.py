"""The rotary table is built on torch's default device, for every RoPE type.

On CUDA an engine builds its model under ``with torch.device("cuda")``; a table whose
frequencies came from transformers' initialiser on the CPU met positions on the GPU and failed
(first seen on an H200, tiny Qwen2 with llama3 scaling). The meta device stands in for a second
device here: nothing may land anywhere but the default one.
"""

from __future__ import annotations

import pytest
import torch

from cluster.models.layers.rotary import RotaryEmbedding
from cluster.models.tiny import tiny_llama_config

ROPE_PARAMETERS = {
    "default": None,
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("rope_type", sorted(ROPE_PARAMETERS))
def test_the_table_lands_on_the_default_device(rope_type):
    params = ROPE_PARAMETERS[rope_type]
    config = tiny_llama_config() if params is None else tiny_llama_config(rope_parameters=params)
    head_dim = config.hidden_size // config.num_attention_heads
    with torch.device("meta"):
        rotary = RotaryEmbedding(config, head_dim, max_position=128)
    assert rotary.cos.device.type == rotary.sin_signed.device.type == "meta"
    assert rotary.cos.shape == rotary.sin_signed.shape == (128, head_dim)
    on_cpu = RotaryEmbedding(config, head_dim, max_position=128)
    assert on_cpu.cos.device.type == "cpu" and torch.isfinite(on_cpu.cos).all()
