"""How ``tandem profile`` times its cells: interleaved rounds, so one slow spell reaches one
sample of many cells instead of every sample of a few (no real timings: a made-up clock)."""

from types import SimpleNamespace

import pytest

from cluster.profiling import profiler


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_cells_are_timed_in_rounds_and_a_slow_spell_does_not_move_their_medians(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(profiler.time, "perf_counter", clock)
    calls = []
    costs = {"a": 0.010, "b": 0.020, "c": 0.030}

    def cell(name):
        def run():
            calls.append(name)
            # the second round (calls 7-9, after 3 warm-ups and one round) runs 3x slower throughout
            clock.now += costs[name] * (3.0 if 7 <= len(calls) <= 9 else 1.0)
        return run

    medians = profiler.time_interleaved([cell("a"), cell("b"), cell("c")], repeats=3)
    assert calls == ["a", "b", "c"] * 4  # a warm-up round, then three rounds of every cell in turn
    assert medians == pytest.approx([0.010, 0.020, 0.030])


def test_batch_sizes_are_profiled_together_only_when_the_cache_holds_them_all():
    def engine(free_blocks):
        return SimpleNamespace(block_manager=SimpleNamespace(block_size=16, num_free_blocks=free_blocks))

    # 1 + 2 + 4 sequences of 40 tokens: 3 blocks each, 21 blocks
    assert profiler._batch_groups(engine(21), [1, 2, 4], 40) == [[1, 2, 4]]
    assert profiler._batch_groups(engine(20), [1, 2, 4], 40) == [[1], [2], [4]]
