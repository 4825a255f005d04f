"""cluster.drafts.head_places: the places a one-token drafter visits, and the engine against them."""

import random

from cluster.drafts.head_places import measure, replay_k1


def test_a_hit_skips_the_next_place_and_a_miss_does_not():
    assert replay_k1([]) == (0, 0)
    assert replay_k1([True, True, False, True, False, False]) == (4, 2)  # places 0, 2, 3, 5
    assert replay_k1([False] * 5) == (5, 0)
    assert replay_k1([True] * 5) == (3, 3)  # places 0, 2, 4


def test_the_engine_accepts_what_the_unrolled_forward_predicts_at_its_places(tiny_llama_dir, tiny_head_dir):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 17, 30, 3, 44, 9)]
    report = measure(str(tiny_llama_dir), str(tiny_head_dir), prompts, 40, "float32", device="cpu",
                     num_blocks=256)
    assert report.requests == len(prompts)
    assert report.engine_accepted > 0 and report.every_place_hits > 0
    # float32 on both sides: the engine's hits are the unrolled forward's at the replayed places
    assert report.requests_matching == report.requests
    assert report.engine_accepted == report.replayed_hits
    assert report.every_place >= report.replayed_places >= report.engine_drafts
