"""Sampler tests: greedy, filters, the sampled distribution, seeds, penalties, banned ids, logprobs.

References no one here wrote: HF ``RepetitionPenaltyLogitsProcessor``, the OpenAI
presence/frequency formula, ``torch.topk``, and a from-scratch numpy reimplementation of
temperature / top-k / top-p / min-p. Statistical tests use fixed seeds and a chi-square bound at
p = 0.001.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from cluster.shared.sampling_params import SamplingParams
from tests.goodness_of_fit import chi2_quantile
from cluster.runner.sampler import (
    Sampler,
    SamplingMetadata,
    apply_penalties,
    compute_probs,
    sample_from_probs,
)

CPU = torch.device("cpu")


def build(params, vocab_size, *, prompts=None, outputs=None, seeds=None, position=0, banned=None):
    """``seeds`` default to each request's own; every row samples output position ``position``."""
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        seeds if seeds is not None else [p.seed for p in params],
        [position] * n,
        banned if banned is not None else [[] for _ in range(n)],
        vocab_size,
        CPU,
    )


# ---------------------------------------------------------------- statistics


def assert_matches_distribution(samples: torch.Tensor, probs: torch.Tensor) -> None:
    """Chi-square goodness of fit at p = 0.001; tokens outside the support must never appear."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token of probability 0"
    expected = probs[support].double() * samples.numel()
    assert expected.min() >= 5, "test setup: expected counts too small for chi-square"
    statistic = ((counts[support] - expected) ** 2 / expected).sum().item()
    df = int(support.sum()) - 1
    assert df >= 2, "test setup: the support is too small to test anything"
    assert statistic < chi2_quantile(0.999, df), (statistic, df, counts, expected)


# ---------------------------------------------------------------- numpy reference


def reference_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """From scratch, float64: temperature, top-k (ties kept), top-p on the top-k distribution, min-p."""
    logits = logits.astype(np.float64)
    if p.greedy:
        out = np.zeros_like(logits)
        out[np.argmax(logits)] = 1.0
        return out
    z = logits / p.temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if 0 < p.top_k < len(z):
        probs[z < np.sort(z)[-p.top_k]] = 0.0
        probs /= probs.sum()
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        num_keep = int(np.searchsorted(np.cumsum(probs[order]), p.top_p)) + 1
        keep = np.zeros(len(z), dtype=bool)
        keep[order[:num_keep]] = True
        probs[~keep] = 0.0
        probs /= probs.sum()
    if p.min_p > 0.0:
        probs[probs < p.min_p * probs.max()] = 0.0
        probs /= probs.sum()
    return probs


def near_a_boundary(logits: np.ndarray, p: SamplingParams, margin: float = 1e-3) -> bool:
    """True when float32 rounding could move a token across a top-p or min-p boundary."""
    z = logits.astype(np.float64) / p.temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if 0 < p.top_k < len(z):
        probs[z < np.sort(z)[-p.top_k]] = 0.0
        probs /= probs.sum()
    cumulative = np.cumsum(np.sort(probs)[::-1])
    ratios = probs / probs.max()
    near_top_p = p.top_p < 1.0 and np.any(np.abs(cumulative - p.top_p) < margin)
    near_min_p = p.min_p > 0.0 and np.any(np.abs(ratios - p.min_p) < margin)
    return bool(near_top_p or near_min_p)


def test_compute_probs_matches_numpy_reference():
    rng = np.random.default_rng(1234)
    vocab_size = 40
    params, rows = [], []
    for _ in range(64):
        p = SamplingParams(
            temperature=float(rng.choice([0.0, 0.3, 0.7, 1.0, 1.6])),
            top_k=int(rng.choice([0, 1, 3, 10, 50])),
            top_p=float(rng.choice([1.0, 0.95, 0.8, 0.5, 0.1])),
            min_p=float(rng.choice([0.0, 0.0, 0.05, 0.2])),
        )
        logits = (rng.standard_normal(vocab_size) * 2.0).astype(np.float32)
        if not p.greedy and near_a_boundary(logits, p):
            continue
        params.append(p)
        rows.append(logits)
    assert len(params) >= 48
    logits = torch.from_numpy(np.stack(rows))
    probs = compute_probs(logits, build(params, vocab_size)).numpy()
    for row, p in enumerate(params):
        expected = reference_probs(rows[row], p)
        np.testing.assert_array_equal(probs[row] > 0, expected > 0, err_msg=f"support of row {row}: {p}")
        np.testing.assert_allclose(probs[row], expected, rtol=1e-4, atol=1e-6, err_msg=f"row {row}: {p}")


# ---------------------------------------------------------------- greedy


def test_all_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(33, 100) * 3
    metadata = build([SamplingParams(temperature=0.0) for _ in range(33)], 100)
    assert metadata.all_greedy and not metadata.all_random
    out = Sampler()(logits, metadata)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None
    probs = compute_probs(logits, metadata)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(dim=-1), 100).float())


def test_mixed_batch_greedy_rows_are_argmax():
    torch.manual_seed(1)
    vocab_size = 50
    params = [
        SamplingParams(temperature=0.0) if i % 3 == 0 else
        SamplingParams(temperature=1e-6) if i % 3 == 1 else  # below the greedy epsilon
        SamplingParams(temperature=0.9, top_p=0.8, seed=i)
        for i in range(30)
    ]
    metadata = build(params, vocab_size)
    assert not metadata.all_greedy and not metadata.all_random
    assert sorted(metadata.seeded) == [i for i in range(30) if i % 3 == 2]
    logits = (torch.randn(30, vocab_size) * 2).to(torch.bfloat16)
    probs = compute_probs(logits, metadata)
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(30))
    sampled = Sampler()(logits, metadata).sampled_token_ids
    greedy_rows = torch.tensor([i % 3 != 2 for i in range(30)])
    argmax = logits.float().argmax(dim=-1)
    assert torch.equal(sampled[greedy_rows], argmax[greedy_rows])
    assert (probs.gather(1, sampled[:, None]) > 0).all()


def test_top_k_one_is_deterministic_argmax():
    torch.manual_seed(2)
    logits = torch.randn(16, 64)
    metadata = build([SamplingParams(temperature=1.3, top_k=1) for _ in range(16)], 64)
    assert torch.equal(Sampler()(logits, metadata).sampled_token_ids, logits.argmax(dim=-1))


# ---------------------------------------------------------------- top-k / top-p / min-p


BASE_PROBS = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])  # most likely first: 1, 3, 4, 2, 0


@pytest.mark.parametrize(
    ("params", "support"),
    [
        (SamplingParams(top_k=2), {1, 3}),
        (SamplingParams(top_k=5), {0, 1, 2, 3, 4}),
        (SamplingParams(top_k=99), {0, 1, 2, 3, 4}),  # >= vocab: off
        (SamplingParams(top_p=0.3), {1}),
        (SamplingParams(top_p=0.69), {1, 3}),
        (SamplingParams(top_p=0.71), {1, 3, 4}),
        (SamplingParams(top_p=0.97), {0, 1, 2, 3, 4}),
        (SamplingParams(min_p=0.3), {1, 3, 4}),  # threshold 0.12
        (SamplingParams(min_p=0.5), {1, 3}),  # threshold 0.2
        (SamplingParams(min_p=1.0), {1}),
        # top-p applies to the top-k distribution renormalized: {1,3,4} -> 0.47, 0.35, 0.18.
        (SamplingParams(top_k=3, top_p=0.8), {1, 3}),
        (SamplingParams(top_k=3, min_p=0.45), {1, 3}),
        # temperature 0.5 squares the probabilities before top-p: 0.56, 0.32, 0.08, ...
        (SamplingParams(temperature=0.5, top_p=0.8), {1, 3}),
        (SamplingParams(temperature=0.5, min_p=0.1), {1, 3, 4}),
    ],
)
def test_filter_support_and_renormalization(params, support):
    # Put the row among unfiltered rows so per-row settings are exercised in one batch.
    batch = [SamplingParams(), params, SamplingParams(temperature=0.0)]
    logits = BASE_PROBS.log().repeat(3, 1)
    probs = compute_probs(logits, build(batch, 5))
    assert set(torch.nonzero(probs[1]).flatten().tolist()) == support
    expected = torch.zeros(5)
    keep = torch.tensor(sorted(support))
    expected[keep] = BASE_PROBS[keep] ** (1 / params.temperature)
    torch.testing.assert_close(probs[1], expected / expected.sum())
    torch.testing.assert_close(probs[0], BASE_PROBS)
    assert torch.equal(probs[2], torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0]))


def test_top_k_keeps_ties_with_kth_token():
    logits = torch.tensor([[2.0, 2.0, 2.0, 1.0, 0.0]])
    probs = compute_probs(logits, build([SamplingParams(top_k=2)], 5))
    assert torch.nonzero(probs[0]).flatten().tolist() == [0, 1, 2]


def test_filter_fast_path_agrees_with_sort_path():
    torch.manual_seed(3)
    params = [SamplingParams(temperature=t) for t in (0.0, 0.5, 1.0, 2.0)]
    metadata = build(params, 30)
    assert metadata.no_top_p_top_k_min_p
    logits = torch.randn(4, 30) * 4
    slow = dataclasses.replace(metadata, no_top_p_top_k_min_p=False)
    torch.testing.assert_close(compute_probs(logits, metadata), compute_probs(logits, slow))


@pytest.mark.parametrize("temperatures, unit", [((1.0, 0.0, 1.0), True), ((1.0, 0.7), False), ((0.0,), True)])
def test_unit_temperature_skips_the_division_bit_for_bit(temperatures, unit):
    torch.manual_seed(5)
    params = [SamplingParams(temperature=t, top_p=0.95) for t in temperatures]
    metadata = build(params, 40)
    assert metadata.unit_temperature is unit
    logits = torch.randn(len(params), 40) * 3
    divided = dataclasses.replace(metadata, unit_temperature=False)
    assert torch.equal(compute_probs(logits, metadata), compute_probs(logits, divided))
    rng_state = torch.random.get_rng_state()
    first = sample_from_probs(compute_probs(logits, metadata), metadata)
    torch.random.set_rng_state(rng_state)
    assert torch.equal(first, sample_from_probs(compute_probs(logits, divided), divided))


def test_compute_probs_is_pure():
    torch.manual_seed(4)
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=5, repetition_penalty=1.5, presence_penalty=1.0)] * 3
    metadata = build(params, 20, prompts=[[1, 2]] * 3, outputs=[[3, 3]] * 3, banned=[[4]] * 3)
    logits = torch.randn(3, 20)
    before = logits.clone()
    first = compute_probs(logits, metadata)
    assert torch.equal(logits, before)
    assert torch.equal(compute_probs(logits, metadata), first)


# ---------------------------------------------------------------- the sampled distribution


DIST_LOGITS = torch.tensor([1.2, 0.1, -0.4, 0.8, -1.6, 0.5, -0.9, 0.0])
DIST_PARAMS = dict(temperature=0.7, top_p=0.9)


def test_unseeded_samples_follow_compute_probs():
    num_samples = 24000
    params = [SamplingParams(**DIST_PARAMS)] * num_samples
    metadata = build(params, 8)
    logits = DIST_LOGITS.repeat(num_samples, 1)
    probs = compute_probs(logits, metadata)
    torch.manual_seed(5)
    samples = Sampler()(logits, metadata).sampled_token_ids
    assert_matches_distribution(samples, probs[0])
    # Independent check of the distribution itself.
    expected = reference_probs(DIST_LOGITS.numpy(), SamplingParams(**DIST_PARAMS))
    np.testing.assert_allclose(probs[0].numpy(), expected, rtol=1e-5, atol=1e-7)


def test_seeded_samples_follow_compute_probs():
    """Seeded rows draw with their seed's number at each output position; pooled over seeds and
    positions, they follow the distribution."""
    num_rows, num_steps = 4000, 5
    params = [SamplingParams(**DIST_PARAMS, seed=i) for i in range(num_rows)]
    logits = DIST_LOGITS.repeat(num_rows, 1)
    probs = compute_probs(logits, build(params, 8))
    samples = torch.cat([sample_from_probs(probs, build(params, 8, position=step)) for step in range(num_steps)])
    assert_matches_distribution(samples, probs[0])


# ---------------------------------------------------------------- seeds


def run_steps(batch, seeded_row, seed, num_steps, vocab_size, global_seed):
    """Sample ``num_steps`` times; return the tokens of ``seeded_row`` (a request with ``seed``)."""
    torch.manual_seed(global_seed)
    seeds = [p.seed for p in batch]
    seeds[seeded_row] = seed
    logits = torch.zeros(len(batch), vocab_size)
    tokens = []
    for step in range(num_steps):
        metadata = build(batch, vocab_size, seeds=seeds, position=step)
        tokens.append(Sampler()(logits, metadata).sampled_token_ids[seeded_row].item())
    return tokens


def test_seeded_row_independent_of_position_and_other_rows():
    vocab_size, num_steps = 64, 12
    mine = SamplingParams(temperature=1.0, seed=7)
    batch_a = [mine, SamplingParams(), SamplingParams(temperature=0.5, seed=3)]
    batch_b = [SamplingParams(temperature=0.0), SamplingParams(seed=99), SamplingParams(top_p=0.5), mine]
    tokens_a = run_steps(batch_a, 0, 7, num_steps, vocab_size, global_seed=0)
    tokens_b = run_steps(batch_b, 3, 7, num_steps, vocab_size, global_seed=123)
    alone = run_steps([mine], 0, 7, num_steps, vocab_size, global_seed=42)
    assert tokens_a == tokens_b == alone
    assert len(set(tokens_a)) > 1, "the numbers must move with the output position"
    assert run_steps(batch_a, 0, 8, num_steps, vocab_size, global_seed=0) != tokens_a


# ---------------------------------------------------------------- penalties


def penalty_case():
    rng = np.random.default_rng(7)
    vocab_size = 32
    prompts = [rng.integers(0, vocab_size, size=n).tolist() for n in (5, 9, 0, 12, 7)]
    outputs = [rng.integers(0, vocab_size, size=n).tolist() for n in (6, 0, 8, 11, 3)]
    logits = torch.from_numpy((rng.standard_normal((5, vocab_size)) * 3).astype(np.float32))
    return vocab_size, prompts, outputs, logits


def hf_repetition(logits_row, prompt, output, penalty):
    ids = torch.tensor([prompt + output], dtype=torch.long)
    return RepetitionPenaltyLogitsProcessor(float(penalty))(ids, logits_row[None].clone())[0]


def openai_presence_frequency(logits_row, output, presence, frequency, vocab_size):
    counts = torch.from_numpy(np.bincount(np.array(output, dtype=np.int64), minlength=vocab_size)).float()
    return logits_row - presence * (counts > 0).float() - frequency * counts


def test_repetition_penalty_matches_transformers():
    vocab_size, prompts, outputs, logits = penalty_case()
    penalties = [1.3, 0.7, 2.0, 1.0, 1.05]
    params = [SamplingParams(repetition_penalty=r) for r in penalties]
    metadata = build(params, vocab_size, prompts=prompts, outputs=outputs)
    before = logits.clone()
    got = apply_penalties(logits, metadata)
    assert torch.equal(logits, before)
    for row, penalty in enumerate(penalties):
        expected = hf_repetition(logits[row], prompts[row], outputs[row], penalty)
        torch.testing.assert_close(got[row], expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[3], logits[3])


def test_presence_frequency_match_openai_formula():
    vocab_size, prompts, outputs, logits = penalty_case()
    presence = [0.0, 0.5, -1.0, 2.0, 1.0]
    frequency = [0.3, 0.0, 1.5, -0.5, 0.0]
    params = [SamplingParams(presence_penalty=p, frequency_penalty=f) for p, f in zip(presence, frequency)]
    metadata = build(params, vocab_size, prompts=prompts, outputs=outputs)
    got = apply_penalties(logits, metadata)
    for row in range(5):
        expected = openai_presence_frequency(logits[row], outputs[row], presence[row], frequency[row], vocab_size)
        torch.testing.assert_close(got[row], expected, rtol=1e-6, atol=1e-6)


def test_all_penalties_together_and_untouched_rows():
    vocab_size, prompts, outputs, logits = penalty_case()
    params = [
        SamplingParams(repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.2),
        SamplingParams(),  # no penalty: bit-for-bit unchanged
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.4),
        SamplingParams(temperature=0.0, presence_penalty=1.5),
        SamplingParams(),
    ]
    metadata = build(params, vocab_size, prompts=prompts, outputs=outputs)
    state = metadata.penalties
    for row in range(5):
        if params[row].needs_penalties:
            counts = np.bincount(np.array(outputs[row], dtype=np.int64), minlength=vocab_size)
            np.testing.assert_array_equal(state.output_counts[row].numpy(), counts)
    got = apply_penalties(logits, metadata)
    for row, p in enumerate(params):
        expected = hf_repetition(logits[row], prompts[row], outputs[row], p.repetition_penalty)
        expected = openai_presence_frequency(
            expected, outputs[row], p.presence_penalty, p.frequency_penalty, vocab_size
        )
        torch.testing.assert_close(got[row], expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[1], logits[1]) and torch.equal(got[4], logits[4])
    # A greedy row takes the argmax after penalties.
    sampled = Sampler()(logits, metadata).sampled_token_ids
    assert sampled[3].item() == got[3].argmax().item()


def test_no_penalty_state_without_penalties():
    metadata = build([SamplingParams(), SamplingParams(temperature=0.0)], 10, outputs=[[1, 1], [2]])
    assert metadata.penalties is None
    logits = torch.randn(2, 10)
    assert apply_penalties(logits, metadata) is logits


# ---------------------------------------------------------------- banned ids


def test_banned_ids_are_never_sampled():
    torch.manual_seed(8)
    vocab_size, num_rows = 16, 600
    banned_ids = [2, 5, 11]
    params = [
        SamplingParams(temperature=0.0) if i % 4 == 0 else SamplingParams(temperature=1.5, seed=i if i % 4 == 1 else None)
        for i in range(num_rows)
    ]
    logits = torch.randn(num_rows, vocab_size)
    logits[:, banned_ids] = 20.0  # the banned tokens would otherwise win
    banned = [banned_ids + [vocab_size + 3] for _ in range(num_rows)]  # out-of-vocab ids are ignored
    metadata = build(params, vocab_size, banned=banned)
    assert metadata.banned_token_ids[0] == banned_ids
    probs = compute_probs(logits, metadata)
    assert (probs[:, banned_ids] == 0).all()
    for _ in range(5):
        sampled = Sampler()(logits, metadata).sampled_token_ids
        assert not torch.isin(sampled, torch.tensor(banned_ids)).any()


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_and_ranked():
    torch.manual_seed(9)
    vocab_size, num_rows = 40, 64
    params = [
        SamplingParams(temperature=3.0, logprobs=[0, 3, 5, None][i % 4], repetition_penalty=1.5 if i % 2 else 1.0)
        for i in range(num_rows)
    ]
    metadata = build(params, vocab_size, prompts=[[0, 1, 2]] * num_rows)
    assert metadata.max_num_logprobs == 5
    logits = torch.randn(num_rows, vocab_size).to(torch.bfloat16)
    out = Sampler()(logits, metadata)
    lp = out.logprobs
    assert lp.token_ids.shape == lp.logprobs.shape == (num_rows, 6)
    raw = torch.log_softmax(logits.float(), dim=-1)  # before penalties and temperature
    sampled = out.sampled_token_ids
    assert torch.equal(lp.token_ids[:, 0], sampled)
    torch.testing.assert_close(lp.logprobs[:, 0], raw.gather(1, sampled[:, None])[:, 0])
    top_values, top_ids = torch.topk(raw, 5, dim=-1)
    assert torch.equal(lp.token_ids[:, 1:], top_ids)
    torch.testing.assert_close(lp.logprobs[:, 1:], top_values)
    assert (lp.logprobs[:, 1:-1] >= lp.logprobs[:, 2:]).all()
    raw_np = raw.numpy()
    expected_rank = [1 + int((raw_np[r] > raw_np[r, sampled[r]]).sum()) for r in range(num_rows)]
    assert lp.sampled_rank.tolist() == expected_rank
    assert max(expected_rank) > 1, "test setup: some row should sample a token other than the top one"


def test_logprobs_wider_than_vocab_and_zero():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    out = Sampler()(logits, build([SamplingParams(temperature=0.0, logprobs=20)], 4))
    assert out.logprobs.token_ids.tolist() == [[3, 3, 2, 1, 0]]
    assert out.logprobs.sampled_rank.tolist() == [1]
    out = Sampler()(logits, build([SamplingParams(temperature=0.0, logprobs=0)], 4))
    assert out.logprobs.token_ids.tolist() == [[3]]


# ---------------------------------------------------------------- metadata


def test_build_flags_and_validation():
    vocab_size = 10
    metadata = build(
        [SamplingParams(temperature=0.0, top_p=0.5), SamplingParams(top_k=vocab_size)],
        vocab_size,
        seeds=[1, 2],
    )
    assert metadata.no_top_p_top_k_min_p  # greedy rows' filters and top_k >= vocab are ignored
    assert metadata.top_k.tolist() == [0, 0]
    assert list(metadata.seeded) == [1]  # a greedy row's seed is not used
    assert metadata.temperature.tolist() == [0.0, 1.0]
    assert metadata.max_num_logprobs is None and metadata.banned_token_ids == {}
    random_only = build([SamplingParams(min_p=0.1)], vocab_size)
    assert random_only.all_random and not random_only.all_greedy and not random_only.no_top_p_top_k_min_p
    with pytest.raises(ValueError, match="one entry per request"):
        SamplingMetadata.build([SamplingParams()], [], [[]], [None], [0], [[]], vocab_size, CPU)


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -0.5])
def test_sampling_params_reject_temperatures_the_sampler_cannot_use(temperature):
    # NaN or inf would turn every probability of the row into NaN (-inf / inf is NaN).
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=temperature)


# ---------------------------------------------------------------- logit bias


def test_logit_bias_matches_transformers_sequence_bias_before_the_penalties():
    """OpenAI's logit_bias is transformers' sequence_bias on one-token sequences; as in vLLM it is
    added before the repetition penalty (which then divides or multiplies the biased logit)."""
    from transformers import SequenceBiasLogitsProcessor

    vocab_size, prompts, outputs, logits = penalty_case()
    biases = [{3: 5.0, 7: -2.5}, {}, {0: -100.0}, {3: 1.0}, {31: 100.0}]
    params = [SamplingParams(logit_bias=b, repetition_penalty=1.3 if row == 3 else 1.0)
              for row, b in enumerate(biases)]
    metadata = build(params, vocab_size, prompts=prompts, outputs=outputs)
    before = logits.clone()
    got = compute_probs(logits, metadata)
    assert torch.equal(logits, before)  # out of place
    for row, bias in enumerate(biases):
        expected = logits[row]
        if bias:
            hf = SequenceBiasLogitsProcessor({(t,): v for t, v in bias.items()})
            expected = hf(torch.tensor([prompts[row] + outputs[row]]), expected[None].clone())[0]
        expected = hf_repetition(expected, prompts[row], outputs[row], params[row].repetition_penalty)
        torch.testing.assert_close(got[row], expected.softmax(-1), rtol=1e-5, atol=1e-7)
    assert metadata.logit_bias[0].tolist() == [0, 0, 2, 3, 4]  # the rows of the biased ids
    assert build([SamplingParams(), SamplingParams()], vocab_size).logit_bias is None


def test_a_strong_bias_decides_the_token():
    vocab_size = 8
    logits = torch.zeros(400, vocab_size)
    params = [SamplingParams(temperature=1.0, logit_bias={1: -100.0, 6: 100.0})] * 200 + \
             [SamplingParams(temperature=0.0, logit_bias={2: 3.0})] * 200
    sampled = Sampler()(logits, build(params, vocab_size)).sampled_token_ids
    assert (sampled[:200] == 6).all() and (sampled[200:] == 2).all()


@pytest.mark.parametrize("bias", [{-1: 1.0}, {True: 1.0}, {"3": 1.0}, {3: float("inf")}, {3: "x"}])
def test_bad_logit_bias_is_refused(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_allowed_token_ids_match_transformers_suppressing_the_rest():
    """vLLM's allowed_token_ids is transformers' SuppressTokensLogitsProcessor of every other id;
    it comes before the logit bias (as in vLLM), and rows without it are untouched."""
    from transformers import SuppressTokensLogitsProcessor

    vocab_size, prompts, outputs, logits = penalty_case()
    allowed = [[1, 4, 9], None, [30], None, [0, 31, 5]]
    params = [SamplingParams(allowed_token_ids=a, logit_bias={4: 2.0} if row == 0 else {})
              for row, a in enumerate(allowed)]
    metadata = build(params, vocab_size)
    before = logits.clone()
    got = compute_probs(logits, metadata)
    assert torch.equal(logits, before)
    for row, ids in enumerate(allowed):
        expected = logits[row].clone()
        if ids is not None:
            others = [t for t in range(vocab_size) if t not in ids]
            expected = SuppressTokensLogitsProcessor(others)(torch.tensor([[0]]), expected[None])[0]
        if row == 0:
            expected[4] += 2.0
        torch.testing.assert_close(got[row], expected.softmax(-1), rtol=1e-5, atol=1e-7)
    assert metadata.allowed_token_ids[0].tolist() == [0, 2, 4]
    sampled = Sampler()(logits.repeat(50, 1), build(params * 50, vocab_size)).sampled_token_ids.view(50, 5)
    for row, ids in enumerate(allowed):
        if ids is not None:
            assert set(sampled[:, row].tolist()) <= set(ids)


@pytest.mark.parametrize("allowed", [[], [-1], [True], ["3"]])
def test_bad_allowed_token_ids_are_refused(allowed):
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=allowed)
