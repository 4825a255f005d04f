"""``tandem bench agent``'s bookkeeping: turns compared with plain decoding's up to each
conversation's first difference, forced calls, dead ends; the engines it builds."""

from __future__ import annotations

from cluster.bench.agent import TurnRecord, compare, engine_configs
from cluster.config import load_config


def _record(conversation, turn, tokens, finish="stop", parsed=True):
    return TurnRecord(conversation, turn, ("named", "required", "auto")[turn % 3], finish, tokens, parsed)


def test_turns_count_as_plain_up_to_a_conversations_first_difference():
    plain = [_record(c, t, [c, t]) for c in range(2) for t in range(3)]
    other = [_record(0, 0, [0, 0]), _record(0, 1, [9], finish="grammar_dead_end", parsed=False),
             _record(0, 2, [0, 2]),  # equal again, but after a difference: not counted
             _record(1, 0, [1, 0]), _record(1, 1, [1, 1]), _record(1, 2, [1, 2], finish="length", parsed=False)]
    result = compare(other, plain)
    assert result["same_as_plain"] == 4
    assert result["first_differences"] == [{"conversation": 0, "turn": 1, "choice": "required"}]
    assert result["dead_ends"] == 1 and result["forced_calls"] == 4 and result["forced_parsed"] == 3
    assert result["auto_parsed"] == 1 and result["finish_reasons"] == {"stop": 4, "grammar_dead_end": 1, "length": 1}
    assert compare(plain, plain)["same_as_plain"] == 6


def test_engines_are_plain_then_each_method_batch_invariant():
    config = load_config("configs/local.yaml")
    configs = engine_configs(config, ["shipped", "suffix"], batch_invariant=True, max_num_seqs=1, max_model_len=8192)
    assert list(configs) == ["plain", f"shipped ({config.speculative.method})", "suffix"]
    assert [c.speculative.method for c in configs.values()] == ["none", config.speculative.method, "suffix"]
    assert all(c.model.batch_invariant and c.model.max_model_len == 8192 for c in configs.values())
    assert all(c.model.quantization == "none" for c in configs.values())  # batch-invariant: full precision
    assert configs["suffix"].speculative.num_speculative_tokens == config.speculative.num_speculative_tokens
