"""The EAGLE-3 head: the published checkpoint layout, and inference that computes what training taught."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from cluster.drafts.head_ttt import unrolled_logits
from cluster.models.eagle3 import load_head, save_head
from cluster.models.layers.cpu_ops import attach_decode_ops
from cluster.models.tiny import tiny_llama_config
from cluster.models.tiny_head import random_head, tiny_head_config
from cluster.runner.input_batch import SHORT_QUERY_MAX, SeqChunk, prepare_inputs

CONFIG = tiny_head_config(tiny_llama_config(num_hidden_layers=6), draft_vocab=96)


def test_saved_heads_load_back_with_the_same_tensors(tmp_path):
    head = random_head(CONFIG, seed=1)
    save_head(head, tmp_path / "head")
    data = json.loads((tmp_path / "head" / "config.json").read_text())
    assert data["architectures"] == ["LlamaForCausalLMEagle3"] and data["draft_vocab_size"] == 96
    loaded = load_head(tmp_path / "head")
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert loaded.config == CONFIG


def _published_tensors(head, prefix: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for name, tensor in head.state_dict().items():
        if name.startswith("rotary."):
            continue
        if name.startswith("midlayer."):
            name = prefix + name.removeprefix("midlayer.")
        tensors[name] = tensor.clone()
    tensors["t2d"] = torch.zeros(CONFIG.vocab_size, dtype=torch.bool)
    return tensors


@pytest.mark.parametrize("prefix, file", [("midlayer.", "pytorch_model.bin"), ("model.layers.0.", "model.safetensors")])
def test_the_published_layouts_load(tmp_path, prefix, file):
    """EAGLE-3's own checkpoints (``midlayer.*`` in pytorch_model.bin, no aux layers named: the
    target's depth gives them) and the ``layers.0`` naming others write."""
    head = random_head(CONFIG, seed=2)
    data = CONFIG.to_json()
    del data["eagle_config"], data["target_hidden_size"]
    tensors = _published_tensors(head, prefix)
    if file.endswith(".bin"):
        torch.save(tensors, tmp_path / file)
    else:
        save_file(tensors, str(tmp_path / file))
    (tmp_path / "config.json").write_text(json.dumps(data))
    loaded = load_head(tmp_path, num_target_layers=6)
    assert loaded.config.aux_layer_ids == (2, 3, 3)
    assert torch.equal(loaded.midlayer.self_attn.q_proj.weight, head.midlayer.self_attn.q_proj.weight)
    assert torch.equal(loaded.d2t, head.d2t)


def test_a_heads_rope_scaling_is_applied(tmp_path):
    """Heads for Llama 3.1 targets name llama3 RoPE scaling; the head rotates as the config says."""
    head = random_head(CONFIG, seed=2)
    save_head(head, tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(data))
    scaled = load_head(tmp_path, max_position=600)
    assert scaled.config.rope_scaling["rope_type"] == "llama3" and scaled.rotary.cos.shape[0] == 600
    assert not torch.allclose(scaled.rotary.cos[:512], head.rotary.cos[:512])


def test_folders_that_are_not_the_layout_are_refused(tmp_path):
    head = random_head(CONFIG, seed=3)
    save_head(head, tmp_path / "ok")
    tensors = _published_tensors(head, "midlayer.")
    del tensors["fc.weight"]
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps(CONFIG.to_json()))
    with pytest.raises(ValueError, match="missing.*fc.weight"):
        load_head(tmp_path)
    tensors = _published_tensors(head, "midlayer.")
    tensors["lm_head.weight"] = torch.zeros(10, CONFIG.hidden_size)
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="lm_head.weight has shape"):
        load_head(tmp_path)
    with pytest.raises(ValueError, match="no config.json"):
        load_head(tmp_path / "absent")
    two_layers = {**CONFIG.to_json(), "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(two_layers))
    with pytest.raises(ValueError, match="one decoder layer"):
        load_head(tmp_path)


@pytest.mark.parametrize("engine_form", [False, True], ids=["as-trained", "fused-with-kernels"])
@torch.no_grad()
def test_drafting_over_the_paged_cache_computes_the_unrolled_training_forward(engine_form):
    """Entry ``t`` reads (target state t, token t + 1); draft step ``j`` at index ``t`` reads the
    step before's output and token ``t + j + 1``: the same numbers, whether unrolled over a whole
    text (training) or one step at a time over the paged cache (the engine, also in the form it
    runs: fused projections, the compiled CPU norm and attention where they built)."""
    head = random_head(CONFIG, seed=4).eval()
    embed = torch.nn.Embedding(CONFIG.vocab_size, CONFIG.hidden_size)
    length, steps, block_size = 21, 3, 4
    torch.manual_seed(5)
    aux = torch.randn(1, length, 3 * CONFIG.hidden_size)
    tokens = torch.randint(0, CONFIG.vocab_size, (1, length))
    dense = unrolled_logits(head, embed, aux, tokens, steps)
    if engine_form:
        head.fuse_projections()
        attach_decode_ops(head, torch.device("cpu"), torch.float32)

    kv = torch.zeros(2, 16 * block_size, CONFIG.num_kv_heads, CONFIG.head_dim)
    table = list(range(16))
    t = 12  # the verified text ends at token t + 1; entries 0..t come from target states
    ids = tokens[0].tolist()

    def run(chunk: SeqChunk, hidden: torch.Tensor) -> torch.Tensor:
        inputs = prepare_inputs([chunk], [table], block_size, torch.device("cpu"), SHORT_QUERY_MAX)
        return head(embed(inputs.input_ids), hidden, inputs.positions, kv, inputs.attn)

    out = run(SeqChunk(ids[1 : t + 2], 0, t + 1), head.fuse(aux[0, : t + 1]))
    torch.testing.assert_close(head.logits(out), dense[0][0, : t + 1], rtol=1e-4, atol=1e-4)
    last = out[-1:]
    for j in range(1, steps):
        last = run(SeqChunk([ids[t + j + 1]], t + j, 1), last)
        torch.testing.assert_close(head.logits(last)[0], dense[j][0, t], rtol=1e-4, atol=1e-4)
