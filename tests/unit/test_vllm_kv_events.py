"""A vLLM replica's prefix index, from vLLM-shaped KV events (no vLLM here): the names it
publishes are the ones the ingress computes for a prompt (``leading_block_hashes``), so the
router's prefix affinity finds vLLM replicas as it finds native ones."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.backends.vllm_kv_events import PrefixIndex
from cluster.routing.prefix_hashes import leading_block_hashes

BS, SEED = 16, 1234


@dataclass
class BlockStored:  # the fields of vLLM's event of that name that the index reads
    block_hashes: list
    parent_block_hash: object
    token_ids: list
    block_size: int = BS
    lora_name: str | None = None
    extra_keys: list | None = None


@dataclass
class BlockRemoved:
    block_hashes: list


class AllBlocksCleared:
    pass


PROMPT = list(range(100, 180))  # 5 full blocks


def _stored(index, first, last, parent, **kw):
    """vLLM stores blocks first..last-1 of PROMPT (its own hashes: 'v<i>')."""
    index.apply(BlockStored([f"v{i}" for i in range(first, last)], parent, PROMPT[first * BS:last * BS], **kw))


def test_the_index_names_blocks_as_the_ingress_names_a_prompts():
    index = PrefixIndex(BS, SEED)
    _stored(index, 0, 3, None)
    _stored(index, 3, 5, "v2")  # a later step extends the chain from its parent
    assert index.cached_prefix_hashes(8) == set(leading_block_hashes(PROMPT, BS, SEED, 8))
    assert index.cached_prefix_hashes(2) == set(leading_block_hashes(PROMPT, BS, SEED, 2))
    assert not index.cached_prefix_hashes(8) & set(leading_block_hashes(PROMPT, BS, SEED + 1, 8))


def test_a_block_whose_parent_went_is_unreachable_and_a_clear_empties_the_index():
    index = PrefixIndex(BS, SEED)
    _stored(index, 0, 4, None)
    index.apply(BlockRemoved(["v1"]))
    assert index.cached_prefix_hashes(8) == set(leading_block_hashes(PROMPT, BS, SEED, 1))
    _stored(index, 4, 5, "v1")  # a child of a block vLLM no longer holds: not named
    assert index.skipped == 1 and len(index.cached_prefix_hashes(8)) == 1
    index.apply(AllBlocksCleared())
    assert index.cached_prefix_hashes(8) == frozenset()


def test_lora_blocks_are_named_with_the_adapter_and_salted_ones_are_left_out():
    index = PrefixIndex(BS, SEED)
    _stored(index, 0, 2, None, lora_name="sql", extra_keys=[("sql",), ("sql",)])
    assert index.cached_prefix_hashes(8) == set(leading_block_hashes(PROMPT, BS, SEED, 2, lora_name="sql"))
    salted = PrefixIndex(BS, SEED)
    _stored(salted, 0, 2, None, extra_keys=[("salt-1",), None])
    other_size = PrefixIndex(BS, SEED)
    other_size.apply(BlockStored(["w0"], None, PROMPT[:24], block_size=24))  # not a multiple of the group's
    assert salted.cached_prefix_hashes(8) == frozenset() and other_size.cached_prefix_hashes(8) == frozenset()


def test_vllms_larger_blocks_carry_the_names_of_their_parts():
    """vLLM on the CPU keeps 128-token blocks; a group of 16 names each of their 8 parts."""
    prompt = list(range(5000, 5000 + 3 * 128))
    index = PrefixIndex(BS, SEED)
    index.apply(BlockStored(["w0"], None, prompt[:128], block_size=128))
    index.apply(BlockStored(["w1", "w2"], "w0", prompt[128:], block_size=128))
    assert index.cached_prefix_hashes(24) == set(leading_block_hashes(prompt, BS, SEED, 24))
    assert index.cached_prefix_hashes(8) == set(leading_block_hashes(prompt, BS, SEED, 8))
    assert index.cached_prefix_hashes(3) == set(leading_block_hashes(prompt, BS, SEED, 3))
