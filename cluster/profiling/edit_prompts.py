"""The prompts of ``tandem bench spec``: edit a passage that is in the prompt.

N-gram (prompt lookup) drafting only pays when the output repeats text of the prompt,
so the workload is the kind of request where that is natural: rewrite, summarize,
proofread or continue a short passage given in full (the shape of RAG answers, code
edits and document chat). Request ``i`` pairs passage ``i`` with task ``i % 4``, so
every task appears at every batch size. Prompts are the model's chat template around
one user message; a tokenizer without a template gets plain ``User: ...`` text.
"""

from __future__ import annotations

TASKS = (
    "Rewrite the following passage in plain, simple English. Keep every fact.",
    "Summarize the following passage in three sentences.",
    "Proofread the following passage and return the corrected text in full.",
    "Continue the following passage with one more paragraph in the same style.",
)

PASSAGES = (
    "The old lighthouse on Gull Point was built in 1874 from granite blocks carried by boat from the mainland. "
    "For ninety years a keeper climbed its one hundred and twelve steps every evening to light the lamp. In 1964 "
    "the light was automated, and the keeper's cottage became a small museum about shipwrecks along the coast.",
    "Sourdough bread rises without bakers' yeast. A starter of flour and water collects wild yeast and lactic "
    "acid bacteria from the air and the grain. The yeast makes the gas that lifts the dough, while the bacteria "
    "make the sour taste. A healthy starter doubles in size within a few hours after it is fed.",
    "Honeybees tell each other where flowers are by dancing. A forager that found nectar walks a figure eight on "
    "the comb, waggling her body in the middle run. The angle of that run against the vertical gives the "
    "direction of the flowers relative to the sun, and the length of the waggle gives the distance.",
    "The city council voted on Tuesday to close Main Street to cars every Sunday from May to September. Shops "
    "may put tables on the pavement, and buses will use Church Road instead. The council will count visitors "
    "and ask shop owners about their sales before it decides whether to keep the plan next year.",
    "A refrigerator moves heat from the inside to the outside. A pump squeezes a refrigerant gas until it is hot, "
    "and coils at the back let that heat escape into the kitchen. The cooled liquid then passes through a narrow "
    "valve, expands, and turns cold, so it can take heat from the food inside before it returns to the pump.",
    "Maria opened the bakery at five in the morning, as she had done for twenty years. She lit the ovens, mixed "
    "the rye dough, and set out the first trays of cinnamon rolls. By six the regular customers were waiting at "
    "the door: the postman, two nurses from the night shift, and a boy who always bought one roll and a milk.",
    "To replace a bicycle inner tube, first let out any air left and lever one side of the tyre off the rim. "
    "Pull out the old tube and run a finger inside the tyre to find the thorn or glass that caused the puncture. "
    "Put a little air in the new tube, tuck it in, push the tyre back onto the rim, and pump it to full pressure.",
    "The monarch butterfly travels farther than almost any other insect. Each autumn millions of monarchs fly "
    "from Canada and the northern United States to the mountain forests of central Mexico, a trip of up to four "
    "thousand kilometres. No single butterfly makes the round trip; it takes three or four generations.",
    "Our team meeting moves from Monday to Wednesday at ten this week, because the office will be closed on "
    "Monday for the electrical inspection. Please bring your project updates and the draft budget for the spring "
    "quarter. If you cannot attend, send your notes to Daniel by Tuesday evening so he can present them.",
    "Glass is made by melting sand, soda ash and limestone at about fifteen hundred degrees Celsius. The soda "
    "lowers the melting point of the sand, and the lime makes the glass stable in water. The hot liquid is "
    "floated on a bed of molten tin to make flat window glass, or blown and pressed into moulds to make bottles.",
    "The village library lends more than books. Members can borrow a sewing machine, a telescope, a set of "
    "garden tools or a ukulele for two weeks at a time. The idea came from a volunteer who noticed how many "
    "people bought expensive tools that they used only once or twice a year.",
    "Rain forms when tiny droplets of water in a cloud collide and join into drops heavy enough to fall. In cold "
    "clouds, ice crystals grow at the expense of the droplets around them and melt into rain on the way down. "
    "A typical raindrop is about two millimetres across and falls at roughly six metres per second.",
    "The museum's new exhibition shows clocks from five centuries, from a water clock used in a Korean palace to "
    "an atomic clock that loses less than a second in a million years. Visitors can open the case of a "
    "pendulum clock and adjust it themselves. The exhibition is open daily until the end of March.",
    "Compost turns kitchen scraps and garden waste into rich soil. Mix green material such as vegetable peels "
    "and grass cuttings with brown material such as dry leaves and cardboard. Keep the heap as damp as a wrung "
    "out sponge and turn it every few weeks, so that air reaches the bacteria that break everything down.",
    "The ferry to Stone Island leaves the harbour at eight, twelve and four o'clock every day except Sunday. The "
    "crossing takes forty minutes. Tickets cost six pounds for adults and three pounds for children, and "
    "bicycles travel free. In bad weather the captain may cancel a crossing, so check the board at the pier.",
    "Octopuses are clever hunters with soft bodies and no bones. An octopus can squeeze through any hole larger "
    "than its beak, change the colour and texture of its skin in a fraction of a second, and open a jar to reach "
    "the crab inside. Most of its neurons are in its eight arms rather than in its brain.",
)


def prompt_messages(i: int) -> list[dict]:
    """The one-message conversation of request ``i`` (cycles through the passages)."""
    passage = PASSAGES[i % len(PASSAGES)]
    return [{"role": "user", "content": f"{TASKS[i % len(TASKS)]}\n\n{passage}"}]


def build_prompt_ids(tokenizer, num_prompts: int, messages_of=prompt_messages) -> tuple[list[list[int]], str]:
    """Token ids of the first ``num_prompts`` prompts (``messages_of(i)``, this workload's
    by default) and the format used (``"chat_template"`` or ``"plain"``). Both systems get
    exactly these ids."""
    templated = bool(getattr(tokenizer, "chat_template", None))
    prompt_ids = []
    for i in range(num_prompts):
        messages = messages_of(i)
        if templated:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            text = "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages) + "Assistant:"
        # A template already holds any BOS it wants; plain text gets the tokenizer's own.
        prompt_ids.append(tokenizer.encode(text, add_special_tokens=not templated))
    return prompt_ids, "chat_template" if templated else "plain"
