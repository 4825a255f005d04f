"""Prefix caching: reuse, equality with the cache off, eviction order, collisions."""

from __future__ import annotations

import random

import pytest

from cluster.shared.request import Request
from cluster.shared.sampling_params import SamplingParams
from cluster.kv.block_manager import BlockManager
from cluster.models.tiny import save_tiny_model, tiny_llama_config
from tests.engine_helpers import drain, make_engine, run_to_completion

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def long_llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_long")
    save_tiny_model(tiny_llama_config(max_position_embeddings=1024), path, seed=2)
    return path


# ---- block manager on its own ---------------------------------------------------------
def _computed(bm: BlockManager, rid: str, tokens: list[int]) -> Request:
    """A request whose tokens are all computed and whose full blocks are cached."""
    request = Request(rid, tokens, SamplingParams(), eos_token_id=None)
    cached = bm.find_cached_prefix(request)
    assert bm.allocate_slots(rid, cached.num_tokens, len(tokens) - cached.num_tokens, cached=cached)
    request.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(request)
    return request


def test_lookup_stops_before_the_last_token_and_at_the_first_miss():
    bm = BlockManager(num_blocks=16, block_size=2)
    _computed(bm, "a", [1, 2, 3, 4, 5, 6, 7])  # blocks [1,2] [3,4] [5,6] cached, [7] partial
    same = Request("b", [1, 2, 3, 4, 5, 6], SamplingParams(), None)
    assert bm.find_cached_prefix(same).num_tokens == 4  # the last token is always recomputed
    longer = Request("c", [1, 2, 3, 4, 5, 6, 8], SamplingParams(), None)
    assert bm.find_cached_prefix(longer).num_tokens == 6
    diverged = Request("d", [1, 2, 9, 4, 5, 6, 8], SamplingParams(), None)
    assert bm.find_cached_prefix(diverged).num_tokens == 2  # [5,6] alone does not count
    salted = Request("e", [1, 2, 3, 4, 5, 6, 8], SamplingParams(), None, cache_salt="tenant-2")
    assert bm.find_cached_prefix(salted).num_tokens == 0
    bm.check_invariants()


def test_eviction_takes_least_recent_leaves_first_and_never_a_referenced_block():
    bm = BlockManager(num_blocks=5, block_size=2)
    _computed(bm, "a", [1, 2, 3, 4, 5, 6])  # a0 a1 a2
    table_a = list(bm.get_block_table("a"))
    _computed(bm, "b", [1, 2, 3, 4, 7, 8])  # shares a0 a1, adds b2
    b2 = bm.get_block_table("b")[2]
    assert bm.get_block_table("b")[:2] == table_a[:2]
    bm.free("a")  # a2 becomes free (cached); a0, a1 still held by b
    assert bm.pool.num_free_blocks == 2  # one never used + a2
    evicted = bm.pool.allocate(2)  # the never-used block, then a2 (a leaf)
    assert table_a[2] in evicted and not set(evicted) & set(table_a[:2])
    bm.pool.free(evicted)
    bm.free("b")  # queue now: ..., b2 (leaf), a1, a0 (parents last)
    order = bm.pool.allocate(bm.pool.num_free_blocks)
    assert order.index(b2) < order.index(table_a[1]) < order.index(table_a[0])
    bm.pool.free(order)
    bm.check_invariants()
    assert bm.pool.num_cached_blocks == 0  # everything was evicted by that allocation


def test_recently_used_prefix_outlives_older_ones():
    bm = BlockManager(num_blocks=4, block_size=2)
    _computed(bm, "old", [1, 2, 3, 4])
    bm.free("old")
    _computed(bm, "new", [5, 6, 7, 8])
    bm.free("new")
    _computed(bm, "x", [9, 10, 11, 12])  # needs 2 blocks: evicts the older prefix
    bm.free("x")
    probe_new = Request("p", [5, 6, 7, 8, 0], SamplingParams(), None)
    probe_old = Request("q", [1, 2, 3, 4, 0], SamplingParams(), None)
    assert bm.find_cached_prefix(probe_new).num_tokens == 4
    assert bm.find_cached_prefix(probe_old).num_tokens == 0


# ---- the engine ---------------------------------------------------------------------------
def test_outputs_equal_with_cache_on_and_off_greedy_and_seeded(tiny_llama_dir):
    rng = random.Random(0)
    system = [rng.randrange(3, 256) for _ in range(40)]
    prompts, params = [], []
    for i in range(6):
        prompts.append(system + [rng.randrange(3, 256) for _ in range(rng.randint(1, 20))])
        params.append(GREEDY if i % 2 else SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=i))
    results = {}
    for caching in (False, True):
        engine = make_engine(tiny_llama_dir, num_blocks=64, block_size=4, enable_prefix_caching=caching)
        first = run_to_completion(engine, prompts[:1], params[:1])  # warm the cache with the system prompt
        results[caching] = first + run_to_completion(engine, prompts[1:], params[1:])
        if caching:
            assert engine.stats().prefix_cache_hits >= 5 * 40 - 5 * 4
    assert results[True] == results[False]


def test_multi_turn_history_is_reused_and_outputs_match(tiny_llama_dir):
    outputs = {}
    computed = {}
    for caching in (False, True):
        rng = random.Random(1)
        engine = make_engine(tiny_llama_dir, num_blocks=128, block_size=4, enable_prefix_caching=caching)
        history = [[rng.randrange(3, 256) for _ in range(30)] for _ in range(3)]
        rng_turns = random.Random(7)
        turns = []
        for _ in range(4):
            user = [[rng_turns.randrange(3, 256) for _ in range(5)] for _ in history]
            prompts = [h + u for h, u in zip(history, user)]
            answers = run_to_completion(engine, prompts, [GREEDY] * len(prompts))
            history = [p + a for p, a in zip(prompts, answers)]
            turns.append(answers)
        outputs[caching] = turns
        computed[caching] = engine.stats().num_computed_tokens
    assert outputs[True] == outputs[False]
    assert computed[True] < computed[False] / 2


def test_shared_512_token_prefix_computes_only_the_new_tokens(long_llama_dir):
    engine = make_engine(long_llama_dir, num_blocks=256, block_size=16)
    rng = random.Random(2)
    prefix = [rng.randrange(3, 256) for _ in range(512)]
    run_to_completion(engine, [prefix + [5, 6, 7]], [SamplingParams(max_tokens=1)])
    before = engine.stats().num_computed_tokens
    second = prefix + [9, 10, 11, 12, 13]
    run_to_completion(engine, [second], [SamplingParams(max_tokens=1)])
    assert engine.stats().num_computed_tokens - before == len(second) - 512


def test_usage_reports_cached_prompt_tokens(long_llama_dir):
    engine = make_engine(long_llama_dir, num_blocks=256, block_size=16)
    prompt = list(range(3, 200))
    engine.add_request(prompt, SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    engine.add_request(prompt, SamplingParams(max_tokens=1))
    last = None
    while engine.has_unfinished():
        for out in engine.step():
            last = out
    assert last.usage.cached_tokens == (len(prompt) - 1) // 16 * 16


def test_forced_hash_collisions_never_serve_wrong_kv(tiny_llama_dir):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(10, 40))] for _ in range(8)]
    prompts += [p[:20] + [rng.randrange(3, 256) for _ in range(6)] for p in prompts[:4]]
    expected = run_to_completion(make_engine(tiny_llama_dir, num_blocks=64, block_size=4, enable_prefix_caching=False),
                    prompts, [GREEDY] * len(prompts))
    engine = make_engine(tiny_llama_dir, num_blocks=64, block_size=4)
    engine.block_manager.hasher.hash_fn = lambda seed, parent, tokens, extra: 42  # every block collides
    got = []
    for p in prompts:  # one at a time so that every lookup meets a colliding cached block
        got += run_to_completion(engine, [p], [GREEDY])
    assert got == expected
    assert engine.stats().num_cached_blocks == 1  # only the first name could be taken


@pytest.mark.parametrize("seed", [0, 1])
def test_random_shared_prefix_workload_with_aborts_returns_every_block(tiny_llama_dir, seed):
    rng = random.Random(seed)
    engine = make_engine(tiny_llama_dir, num_blocks=20, block_size=4, max_num_seqs=5, max_num_batched_tokens=24)
    prefixes = [[rng.randrange(3, 256) for _ in range(rng.choice([8, 13, 24]))] for _ in range(3)]
    live: set[str] = set()
    for step in range(300):
        if step < 150 and rng.random() < 0.4:
            prompt = rng.choice(prefixes) + [rng.randrange(3, 256) for _ in range(rng.randint(1, 12))]
            live.add(engine.add_request(prompt, SamplingParams(max_tokens=rng.randint(1, 16),
                                                               temperature=rng.choice([0, 1.0]))))
        if live and rng.random() < 0.1:
            victim = rng.choice(sorted(live))
            engine.abort(victim)
            live.discard(victim)
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
        engine.check_invariants()
    drain(engine, live)
    stats = engine.stats()
    assert not live and stats.kv_cache_usage == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.pool.num_blocks
    assert stats.prefix_cache_hits > 0 and engine.block_manager.pool.num_evictions > 0
