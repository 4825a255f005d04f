"""End to end: tokens sampled with speculation follow the target's exact distribution.

The reference joint distribution of the first two output tokens comes from
transformers' forward pass on the target and its own sampling warpers (temperature,
top-p), not from our sampler.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from cluster.config import TandemConfig, with_overrides
from cluster.engine.engine import Engine
from cluster.shared.sampling_params import SamplingParams
from cluster.models.tiny import save_tiny_model, tiny_llama_config
from tests.goodness_of_fit import chi2_quantile, chi2_statistic

VOCAB = 12
PROMPT = [3, 5, 7, 1]
NUM_SAMPLES = 3000


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    config = tiny_llama_config(vocab_size=VOCAB, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    target = save_tiny_model(config, tmp_path_factory.mktemp("dist_target"), seed=3)
    draft = save_tiny_model(config, tmp_path_factory.mktemp("dist_draft"), seed=4)  # disagrees often
    return target, draft


def _reference_joint(target, temperature: float, top_p: float) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    warpers = [TemperatureLogitsWarper(temperature)] + ([TopPLogitsWarper(top_p)] if top_p < 1 else [])

    def next_probs(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[:, -1].double()
        for w in warpers:
            logits = w(torch.tensor([ids]), logits)
        return torch.softmax(logits, -1)[0].numpy()

    first = next_probs(PROMPT)
    return np.stack([first[t] * next_probs(PROMPT + [t]) for t in range(VOCAB)])  # [VOCAB, VOCAB]


def sample_pairs(target, spec: dict, temperature: float, top_p: float, verification: str) -> np.ndarray:
    """Joint counts of the first two tokens of NUM_SAMPLES seeded requests; ``spec``: the speculation
    settings (a draft model or head: some of its drafts must be accepted, not all)."""
    engine = Engine(with_overrides(TandemConfig(), model=str(target), device="cpu", num_blocks=1200,
                                   block_size=4, max_num_seqs=512, num_speculative_tokens=2,
                                   verification=verification, **spec))
    for seed in range(NUM_SAMPLES):
        # The first token comes from the prefill; the second from verifying a draft.
        engine.add_request(PROMPT, SamplingParams(max_tokens=3, temperature=temperature, top_p=top_p,
                                                  seed=seed, ignore_eos=True))
    counts = np.zeros((VOCAB, VOCAB))
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                a, b = out.outputs[0].token_ids[:2]
                counts[a, b] += 1
    if spec:
        spec_stats = engine.stats().spec
        assert 0 < spec_stats.num_accepted_tokens < spec_stats.num_draft_tokens
    return counts


@pytest.mark.parametrize("verification", ["auto", "rejection"])  # seeded requests: auto verifies by coupling
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (1.0, 0.7)])
def test_speculative_samples_follow_the_target_joint_distribution(models, temperature, top_p, verification):
    target, draft = models
    joint = _reference_joint(target, temperature, top_p)
    counts = sample_pairs(target, dict(method="draft", draft_model=str(draft)), temperature, top_p, verification)
    statistic, df = chi2_statistic(counts, joint)
    assert statistic < chi2_quantile(0.999, df), (statistic, df)


@pytest.mark.parametrize("verification", ["auto", "rejection"])
def test_suffix_drafts_from_other_requests_keep_the_target_distribution(models, verification):
    """Suffix drafts come from the other requests' sampled responses (the replica-wide tree), which
    follow the target itself: the most frequent continuation is drafted, and the exact verification
    must still leave the target's joint distribution."""
    target, _ = models
    joint = _reference_joint(target, 1.0, 1.0)
    counts = sample_pairs(target, dict(method="suffix"), 1.0, 1.0, verification)
    statistic, df = chi2_statistic(counts, joint)
    assert statistic < chi2_quantile(0.999, df), (statistic, df)
