"""A tiny EAGLE-3 head trained on the engine tests' own texts (random ones: cluster/models/tiny_head.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from cluster.models.eagle3 import default_aux_layers, save_head
from cluster.models.tiny_head import save_random_head


def train_tiny_head(target_dir: Path, out: Path, steps: int = 300, seed: int = 0) -> Path:
    """A head for a tiny target trained on its answers (greedy, and sampled at temperature 0.7 the way
    an engine with a head samples seeded requests) to the prompts the engine tests send and random
    ones, with the library's own pieces: it agrees with the target often on those tests (it learns
    those texts by heart; what they check is exactness)."""
    import random

    from cluster.drafts.head_data import Text, extract_features
    from cluster.drafts.head_train import Batches, choose_draft_vocab, head_config, new_head
    from cluster.drafts.head_ttt import loss, unrolled_logits
    from cluster.drafts.prune import load_target
    from cluster.engine.llm import LLM
    from cluster.models.loader import resolve_model
    from cluster.shared.sampling_params import SamplingParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(3, 40))] for _ in range(40)]
    prompts += [[rng.randrange(3, 256) for _ in range(rng.randint(2, 6))] * 4 for _ in range(8)]
    tests = random.Random(0)  # tests/unit/test_spec_decode.py's and test_eagle3_engine.py's prompts
    prompts += [[tests.randrange(3, 256) for _ in range(n)] for n in (5, 17, 30, 3, 44, 9)]
    seeded = [5, 6, 7, 8, 9] * 4  # tests/unit/test_seeded_speculation.py's request
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)] * len(prompts) + [
        SamplingParams(max_tokens=40, temperature=0.7, seed=i, ignore_eos=True) for i in range(len(prompts))] + [
        SamplingParams(max_tokens=32, temperature=0.7, top_p=0.95, seed=1234, ignore_eos=True)]
    # Seeded text depends on the sampler an engine with a head uses, not on the head or k: any head, k = 0.
    random_dir = save_random_head(load_target(resolve_model(str(target_dir))).config, Path(out) / "random", 64)
    llm = LLM(model=str(target_dir), device="cpu", num_blocks=512, max_num_seqs=96, method="eagle3",
              draft_model=str(random_dir), num_speculative_tokens=0)
    outputs = llm.generate(prompts + prompts + [seeded], params)
    texts = [Text(list(o.prompt_token_ids) + list(o.outputs[0].token_ids), len(o.prompt_token_ids)) for o in outputs]
    model = load_target(resolve_model(str(target_dir)))
    features = extract_features(model, texts, default_aux_layers(model.config.num_hidden_layers), None)
    vocab_ids = choose_draft_vocab(features.labels, model.config.vocab_size, 192)
    head = new_head(head_config(model.config, len(vocab_ids)), vocab_ids,
                    model.get_output_embeddings().weight.detach(), seed)
    embed = model.get_input_embeddings()
    t2d = torch.full((model.config.vocab_size,), -1, dtype=torch.int64)
    t2d[vocab_ids] = torch.arange(len(vocab_ids))
    aux, tokens, labels, answer = Batches(texts, features, 512).rows(list(range(len(texts))))
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for _ in range(steps):
        value = loss(unrolled_logits(head, embed, aux.float(), tokens, 2), labels, answer, t2d, 0.8)
        optimizer.zero_grad()
        value.backward()
        optimizer.step()
    save_head(head, Path(out))
    return Path(out)
