"""Prefix names for routing: the router's hashes equal the engine's, and a block manager
publishes its cached names by depth in the prefix tree."""

from __future__ import annotations

from cluster.shared.sampling_params import SamplingParams
from cluster.kv.block_manager import BlockManager
from cluster.kv.prefix_cache import ROOT_HASH, BlockHash
from cluster.routing.prefix_hashes import leading_block_hashes
from tests.engine_helpers import drain, make_engine

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def test_leading_block_hashes_equal_the_engines_block_hashes(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=64, block_size=4)
    seed = engine.block_manager.hasher.seed
    prompt = [(7 * i + 3) % 200 + 3 for i in range(22)]  # 5 full blocks of 4, 2 tokens over
    plain = engine.add_request(prompt, GREEDY)
    salted = engine.add_request(prompt, GREEDY, cache_salt="tenant-2")
    engine.step()
    for rid, salt in ((plain, None), (salted, "tenant-2")):
        request = engine.scheduler.requests[rid]
        engine_values = tuple(h.value for h in request.block_hashes[:5])
        assert len(engine_values) == 5
        assert leading_block_hashes(prompt, 4, seed, max_blocks=8, cache_salt=salt) == engine_values
        assert leading_block_hashes(prompt, 4, seed, max_blocks=3, cache_salt=salt) == engine_values[:3]
    assert leading_block_hashes(prompt, 4, seed, 5) != leading_block_hashes(prompt, 4, seed, 5, "tenant-2")
    assert leading_block_hashes(prompt, 4, seed, 0) == ()
    assert leading_block_hashes(prompt[:3], 4, seed, 8) == ()


def test_cached_prefix_hashes_by_depth_on_an_engine(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=64, block_size=4)
    shared = [(5 * i + 1) % 200 + 3 for i in range(12)]  # 3 shared blocks
    prompt_a = shared + [10, 11, 12, 13, 14, 15, 16, 17]
    prompt_b = shared + [20, 21, 22, 23, 24, 25, 26, 27]
    requests = []
    for prompt in (prompt_a, prompt_b):
        rid = engine.add_request(prompt, GREEDY)
        requests.append(engine.scheduler.requests[rid])
    drain(engine, set())
    assert engine.block_manager.num_free_blocks == 64  # all free, some still cached
    a, b = ([h.value for h in r.block_hashes] for r in requests)
    assert a[:3] == b[:3] and a[3] != b[3]
    bm = engine.block_manager
    assert bm.cached_prefix_hashes(0) == frozenset()
    assert bm.cached_prefix_hashes(3) == frozenset(a[:3])
    assert bm.cached_prefix_hashes(4) == frozenset(a[:4] + b[3:4])
    # 20 prompt + 8 output tokens, 27 computed: 6 full blocks each, all cached and free.
    everything = bm.cached_prefix_hashes(100)
    assert everything == frozenset(a[:6] + b[3:6])
    assert len(everything) == bm.pool.num_cached_blocks
    engine.check_invariants()


def test_cached_prefix_hashes_skip_blocks_whose_parent_is_not_cached():
    bm = BlockManager(num_blocks=4, block_size=2)
    blocks = bm.pool.allocate(3)
    bm.pool.cache_block(blocks[0], BlockHash(10, ROOT_HASH, (1, 2), ()))
    bm.pool.cache_block(blocks[1], BlockHash(11, 10, (3, 4), ()))
    bm.pool.cache_block(blocks[2], BlockHash(21, 20, (5, 6), ()))  # parent 20 was evicted
    assert bm.cached_prefix_hashes(5) == frozenset({10, 11})
    assert bm.cached_prefix_hashes(1) == frozenset({10})
    bm.pool.free(blocks)
    bm.check_invariants()
    taken = bm.pool.allocate(2)  # the uncached block, then the least recently freed: 10's, evicted
    assert blocks[0] in taken
    assert bm.cached_prefix_hashes(5) == frozenset()  # 11 now hangs off an evicted parent
    bm.pool.cache_block(blocks[0], BlockHash(10, ROOT_HASH, (1, 2), ()))  # computed again
    assert bm.cached_prefix_hashes(5) == frozenset({10, 11})
    bm.pool.free(taken)
    bm.check_invariants()
