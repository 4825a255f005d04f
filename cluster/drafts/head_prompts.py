"""Prompts a draft head trains on, made here rather than downloaded.

Two rounds, both answered by the target itself (:mod:`cluster.drafts.head_data`):

1. :func:`open_prompts`: a task template around a subject ("Explain how a bicycle gear works
   to a child.", "Write a short story about a lighthouse keeper."), every pairing of
   :data:`TEMPLATES` and :data:`SUBJECTS` in a seeded order;
2. :func:`edit_prompts`: round 1's answers become passages that an edit task (rewrite,
   summarize, proofread, continue, ...) is asked about, the shape of ``tandem bench spec``'s
   workload, whose own passages (:mod:`cluster.profiling.edit_prompts`) are never trained on
   and measure the head on text it has not seen.
"""

from __future__ import annotations

import random

TEMPLATES = (
    "Explain how {s} works, in a short paragraph.",
    "Explain {s} to a ten-year-old.",
    "Write a short story about {s}.",
    "Write a poem about {s}.",
    "List five facts about {s}.",
    "Give three tips for someone learning about {s}.",
    "Describe {s} in vivid detail.",
    "What are the advantages and disadvantages of {s}?",
    "Write a product description for {s}.",
    "Write a short news report about {s}.",
    "Write an email to a friend about {s}.",
    "Summarize the history of {s} in a few sentences.",
    "What are common misconceptions about {s}?",
    "Give a step by step guide related to {s}.",
    "Write a dialogue between two people discussing {s}.",
    "Compare {s} with something similar and explain the differences.",
    "Write a short speech about {s}.",
    "Answer briefly: why does {s} matter?",
    "Write a diary entry of someone who spent the day with {s}.",
    "Write five quiz questions about {s}, with answers.",
)

SUBJECTS = (
    "a bicycle", "the moon", "volcanoes", "a public library", "coffee", "the human heart", "rain forests",
    "a chess game", "electric cars", "honey", "the internet", "a city park", "winter", "recycling", "whales",
    "a school bus", "solar panels", "the piano", "bread baking", "a mountain hike", "friendship", "the ocean tides",
    "a thunderstorm", "vaccines", "a train journey", "gardening", "the printing press", "earthquakes", "tea",
    "a lighthouse keeper", "robots", "the Roman empire", "a hospital night shift", "photosynthesis", "money",
    "a birthday party", "mushrooms", "airplanes", "a small town market", "sleep", "the color blue", "a dog",
    "a cat", "the solar system", "bridges", "a violin", "video games", "clouds", "the stock market", "a desert",
    "glaciers", "a farmer", "the first day of school", "smartphones", "a museum", "rivers", "soap", "a kite",
    "the wheel", "penguins", "an old map", "the immune system", "wind turbines", "a marathon", "chocolate",
    "a thrift store", "the alphabet", "a campfire", "fireworks", "a post office", "owls", "a cooking class",
    "time zones", "a hot air balloon", "a submarine", "bees", "a board game night", "the Great Wall of China",
    "a newspaper", "ants", "a recipe for soup", "the weather forecast", "a job interview", "a library card",
    "a spaceship", "a village bakery", "the brain", "a broken umbrella", "a snowman", "the Olympic games",
    "a fishing trip", "a vegetable garden", "a rainy Sunday", "a computer virus", "the telephone", "a forest fire",
    "a wedding", "an island", "a cup of tea", "a camera", "a detective", "a dragon", "a pirate ship", "a robot chef",
    "a music festival", "a storm at sea", "a haunted house", "a science fair", "a zoo", "a space station",
)

EDIT_TASKS = (
    "Rewrite the following passage in plain, simple English. Keep every fact.",
    "Summarize the following passage in three sentences.",
    "Proofread the following passage and return the corrected text in full.",
    "Continue the following passage with one more paragraph in the same style.",
    "Rewrite the following passage in a more formal tone.",
    "Turn the following passage into a bulleted list of its main points.",
    "Shorten the following passage to half its length.",
    "Rewrite the following passage for a young reader.",
)


def open_prompts(num: int, seed: int) -> list[str]:
    """``num`` distinct template-subject prompts in a seeded order (at most every pairing)."""
    pairs = [(t, s) for t in TEMPLATES for s in SUBJECTS]
    if num > len(pairs):
        raise ValueError(f"at most {len(pairs)} open prompts can be made, asked for {num}")
    random.Random(seed).shuffle(pairs)
    return [t.format(s=s) for t, s in pairs[:num]]


def edit_prompts(passages: list[str], seed: int) -> list[str]:
    """One edit task per passage, seeded."""
    rng = random.Random(seed)
    return [f"{rng.choice(EDIT_TASKS)}\n\n{p.strip()}" for p in passages]
