"""Calibration prompts for measuring acceptance: chat requests of the kinds users send,
some that quote text back (where prompt lookup shines) and some open-ended."""

CALIBRATION_PROMPTS = [
    "Summarize this in one sentence: The library opens at nine in the morning and closes at six in the "
    "evening. On Saturdays it closes at noon, and on Sundays it is closed all day.",
    "Fix the spelling in this sentence and repeat it: Teh quick brown fox jumpd over the lazzy dog.",
    "Write a Python function that returns the factorial of n, then show how to call it for n = 5.",
    "Explain in three short sentences why the sky is blue.",
    "Translate into plain English: The meeting has been postponed until further notice due to "
    "unforeseen circumstances.",
    "List five fruits that are red, one per line.",
    "Continue the list: Monday, Tuesday, Wednesday,",
    "Rewrite this more politely: Send me the report now.",
    "What are the first ten prime numbers?",
    "Give a two-sentence description of a lighthouse at night.",
    "Convert this list to a numbered list: apples, pears, plums, cherries, grapes.",
    "Write a haiku about autumn leaves.",
]
