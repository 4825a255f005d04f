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
    "Write a letter of complaint about {s}.",
    "Explain {s} as a teacher would to a new class.",
    "Write a blog post introducing {s}.",
    "What would the world be like without {s}?",
    "Write a short mystery that involves {s}.",
    "Describe a typical day that involves {s}.",
    "Give a short lesson plan for teaching {s}.",
    "Write an advertisement for {s}, in a cheerful tone.",
    "Explain what a scientist would find interesting about {s}.",
    "Write the opening of a novel in which {s} plays a part.",
    "Describe {s} from the point of view of a visitor from another planet.",
    "Write a limerick about {s}.",
    "What questions do children often ask about {s}? Answer two of them.",
    "Write a short review of {s}.",
    "Explain how {s} has changed over the last hundred years.",
    "Plan a weekend around {s}.",
    "Write a fairy tale about {s}.",
    "Write instructions for taking care of {s}.",
    "Write a short interview with an expert on {s}.",
    "Explain the most surprising thing about {s}.",
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
    "an orchestra", "a lost wallet", "a garden snail", "the northern lights", "a typewriter", "a tram", "salt",
    "a waterfall", "a beehive", "the Eiffel Tower", "a coral reef", "a lighthouse", "a castle", "a blacksmith",
    "an apple tree", "the printing of money", "a compass", "a microscope", "a telescope", "a clock tower",
    "a rainbow", "a sandcastle", "a library book", "a football match", "a tennis racket", "a swimming pool",
    "a harbor", "a ferry", "a windmill", "a water well", "a pencil", "an eraser", "a notebook", "a backpack",
    "a refrigerator", "a washing machine", "a vacuum cleaner", "an elevator", "a traffic light", "a roundabout",
    "a highway", "a tunnel", "a subway", "a bus driver", "a nurse", "a firefighter", "a pilot", "an astronaut",
    "a carpenter", "a chef", "a librarian", "a mail carrier", "a beekeeper", "a shepherd", "a gardener",
    "a painter", "a sculptor", "a poet", "a magician", "a clown", "a tailor", "a baker", "a dentist",
    "the Amazon river", "the Sahara", "Antarctica", "the Himalayas", "the Pacific Ocean", "a rice field",
    "a vineyard", "an olive grove", "a dairy farm", "a fish market", "a flower shop", "a bookshop",
    "a toy store", "a hardware store", "a pharmacy", "a bakery oven", "a pizza", "noodles", "cheese",
    "strawberries", "potatoes", "corn", "lemons", "pepper", "olive oil", "ice cream", "pancakes",
    "a picnic", "a road trip", "a camping tent", "a sleeping bag", "a canoe", "a sailboat", "a surfboard",
    "a skateboard", "roller skates", "a snowboard", "a sled", "a horse", "a cow", "a goat", "a parrot",
    "a goldfish", "a turtle", "an elephant", "a giraffe", "a lion", "a wolf", "a fox", "a squirrel",
    "a hedgehog", "a butterfly", "a spider", "a frog", "a shark", "an octopus", "a dolphin", "a jellyfish",
    "dinosaurs", "fossils", "gold", "iron", "glass", "paper", "plastic", "cotton", "wool", "silk",
    "electricity", "magnets", "gravity", "light", "sound", "heat", "water", "ice", "air", "fire",
    "the calendar", "a leap year", "a birthday cake", "a holiday", "a parade", "a circus", "a puppet show",
    "a theater play", "a movie", "a radio", "television", "a podcast", "a website", "email", "a password",
    "a spreadsheet", "a robot vacuum", "3D printing", "a drone", "a satellite", "a rocket launch",
    "a comet", "Mars", "Jupiter", "the sun", "a black hole", "the stars", "a night sky", "the seasons",
    "autumn leaves", "spring flowers", "summer vacation", "a heat wave", "fog", "snow", "a tornado",
    "a flood", "a drought", "a volcano island", "a cave", "a canyon", "a lake", "a pond", "a swamp",
    "a meadow", "a hill", "a valley", "a beach", "sand dunes", "a rock", "a diamond", "a crown",
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
