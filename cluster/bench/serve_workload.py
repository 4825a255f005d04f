"""What ``tandem bench serve`` sends and when: datasets of prompts and seeded arrival times.

Datasets (all seeded, none needs a tokenizer):

* ``random``: prompts of random words from :data:`VOCABULARY`, a fixed list of short,
  common English words that most BPE tokenizers keep as one token each (with the
  leading space). Lengths are therefore *approximate* token counts: ``prompt_len`` is a
  word count, and the server's ``usage.prompt_tokens`` is what the metrics report when
  it is present. Input and output lengths are drawn uniformly from
  ``[floor(len * (1 - r)), ceil(len * (1 + r))]`` as in vLLM's random dataset.
* ``shared-prefix``: a chat workload; ``num_prefixes`` long system prompts, each shared
  by many requests, each request with a short user question of its own. Requests are
  spread round-robin over the prefixes, then shuffled.
* ``instructions``: the short instructions in ``data/instructions.jsonl`` (written for
  this project), shuffled and cycled to ``num_requests``.

Arrivals follow vLLM: the gaps between requests are gamma distributed with shape
``burstiness`` and mean ``1 / rate`` (``burstiness == 1`` is a Poisson process, smaller is
burstier, larger is more regular); the first request goes out at time 0; ``rate == inf``
sends everything at once. Phased traffic is a list of ``rate:seconds`` pieces; phase ``i``
covers ``[t_i, t_i + seconds)`` and its arrivals are the same gamma process at its own
rate, restarted at the phase boundary (a rate of 0 is a silent phase).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("random", "shared-prefix", "instructions")
INSTRUCTIONS_PATH = Path(__file__).parent / "data" / "instructions.jsonl"
VOCABULARY = (
    "the of and to in is it for on was with as at by be this have from or one had not but what all were "
    "when we there can an your which their said if do will each about how up out them then she many some "
    "so these would other into has more her two like him see time could no make than first been its who "
    "now people my made over did down only way find use may water long little very after words called "
    "just where most know get through back much before go good new write our used me man too any day same "
    "right look think also around another came come work three word must because does part even place well"
).split()


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload. ``prompt_len`` is approximate (words, system prompt included)."""

    prompt: str  # the user's text
    output_len: int  # sent as max_tokens
    prompt_len: int
    system: str | None = None  # a system prompt (the shared-prefix dataset)

    def completion_prompt(self) -> str:
        """The text for ``/v1/completions``: the system prompt, a blank line, the user text."""
        return self.prompt if self.system is None else f"{self.system}\n\n{self.prompt}"

    def messages(self) -> list[dict]:
        """The ``messages`` for ``/v1/chat/completions``."""
        user = [{"role": "user", "content": self.prompt}]
        return user if self.system is None else [{"role": "system", "content": self.system}, *user]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(VOCABULARY, k=n))


def length_range(length: int, range_ratio: float, low_floor: int) -> tuple[int, int]:
    return max(low_floor, math.floor(length * (1 - range_ratio))), max(low_floor, math.ceil(length * (1 + range_ratio)))


def random_requests(num_requests: int, input_len: int, output_len: int, range_ratio: float,
                    seed: int) -> list[BenchRequest]:
    """Random-word prompts of about ``input_len`` words, ``output_len`` max tokens, +- ``range_ratio``."""
    if input_len < 1 or output_len < 1:
        raise ValueError(f"random input and output lengths must be >= 1, got {input_len} and {output_len}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    in_lo, in_hi = length_range(input_len, range_ratio, 1)
    out_lo, out_hi = length_range(output_len, range_ratio, 1)
    requests = []
    for _ in range(num_requests):
        n_in = rng.randint(in_lo, in_hi)
        requests.append(BenchRequest(_words(rng, n_in), rng.randint(out_lo, out_hi), n_in))
    return requests


def shared_prefix_requests(num_requests: int, num_prefixes: int, prefix_len: int, question_len: int,
                           output_len: int, seed: int) -> list[BenchRequest]:
    """``num_prefixes`` system prompts of ``prefix_len`` words of notes, each request a distinct
    question of about ``question_len`` words; every request gets ``output_len`` max tokens."""
    if num_prefixes < 1 or prefix_len < 1 or question_len < 1 or output_len < 1:
        raise ValueError("--num-prefixes, --prefix-len, --question-len and --output-len must be >= 1")
    rng = random.Random(seed)
    systems = [f"You are assistant number {i}. Answer from these notes: {_words(rng, prefix_len)}"
               for i in range(num_prefixes)]
    requests = []
    for j in range(num_requests):
        system = systems[j % num_prefixes]
        question = f"Question {j}: what do the notes say about {_words(rng, question_len)}?"
        requests.append(BenchRequest(question, output_len, len(system.split()) + len(question.split()), system))
    rng.shuffle(requests)
    return requests


def load_instructions(path: Path = INSTRUCTIONS_PATH) -> list[str]:
    """The ``prompt`` of every JSON line of ``path``; ValueError names a bad line."""
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            prompt = json.loads(line)["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{path}:{number}: expected a JSON object with a \"prompt\" string ({err})") from None
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{path}:{number}: \"prompt\" must be a non-empty string")
        prompts.append(prompt)
    if not prompts:
        raise ValueError(f"{path} holds no instructions")
    return prompts


def instruction_requests(num_requests: int, output_len: int, seed: int,
                         path: Path = INSTRUCTIONS_PATH) -> list[BenchRequest]:
    """The shipped instructions, shuffled with ``seed`` and cycled; ``output_len`` max tokens each."""
    if output_len < 1:
        raise ValueError(f"--output-len must be >= 1, got {output_len}")
    prompts = load_instructions(path)
    random.Random(seed).shuffle(prompts)
    return [BenchRequest(prompts[i % len(prompts)], output_len, len(prompts[i % len(prompts)].split()))
            for i in range(num_requests)]


@dataclass(frozen=True)
class Phase:
    """A stretch of traffic at one rate; 0 is silence."""

    rate: float  # requests per second
    duration_s: float


def parse_phases(text: str) -> tuple[Phase, ...]:
    """``"2:30,8:60"``: 2 req/s for 30 s, then 8 req/s for 60 s."""
    phases = []
    for piece in text.split(","):
        rate, sep, seconds = piece.strip().partition(":")
        try:
            phase = Phase(float(rate), float(seconds))
        except ValueError:
            phase = None
        if not sep or phase is None or not (0 <= phase.rate < math.inf and 0 < phase.duration_s < math.inf):
            raise ValueError(f"bad phase {piece.strip()!r} in {text!r}: expected rate:seconds with a finite "
                             "rate >= 0 requests/s and seconds > 0, e.g. 2:30,8:60")
        phases.append(phase)
    return tuple(phases)


def check_process(rate: float, burstiness: float) -> None:
    if not rate > 0:
        raise ValueError(f"the request rate must be > 0 requests/s (or inf), got {rate}")
    if not 0 < burstiness < math.inf:
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")


def _gap(rng: random.Random, rate: float, burstiness: float) -> float:
    """One inter-arrival gap: gamma with shape ``burstiness`` and mean ``1 / rate``."""
    return rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


def arrival_times(num_requests: int, rate: float, burstiness: float, seed: int) -> tuple[float, ...]:
    """Send times in seconds from the start, ascending; the first is 0, all are 0 when rate is inf."""
    check_process(rate, burstiness)
    if rate == math.inf:
        return (0.0,) * num_requests
    rng = random.Random(seed)
    times, now = [], 0.0
    for i in range(num_requests):
        if i:
            now += _gap(rng, rate, burstiness)
        times.append(now)
    return tuple(times)


def phased_arrival_times(phases: tuple[Phase, ...], burstiness: float, seed: int) -> tuple[float, ...]:
    """Send times of the phased process, ascending; every time lies inside its phase."""
    check_process(1.0, burstiness)
    rng = random.Random(seed)
    times, start = [], 0.0
    for phase in phases:
        end = start + phase.duration_s
        now = start
        while phase.rate > 0:
            now += _gap(rng, phase.rate, burstiness)
            if now >= end:
                break
            times.append(now)
        start = end
    return tuple(times)
