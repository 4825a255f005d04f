"""Why a head's acceptance in the engine differs from its held-out figure: the places it drafts.

    python -m cluster.drafts.head_places --target smollm2-135m-instruct \
        --head smollm2-135m-instruct-eagle3 [--max-tokens 64] [--dtype bfloat16] [--json PATH]

``head_report.json`` scores a head at every answer place of its held-out texts (the unrolled
training forward, :mod:`cluster.drafts.head_ttt`). The engine drafting one token a step does not
visit every place: an accepted draft moves it two places on, so the place after each hit is
never drafted, and hits come in runs. This tool has the engine answer ``tandem bench spec``'s
prompts greedily with ``k = 1`` (its per-request counts give the drafts and hits), then scores the
same answers with the unrolled forward three ways: at every answer place, at the places a
``k = 1`` engine would visit given those hits (replayed), and per span of the answer. Where the
replayed figure matches the engine's, the engine computes what the head was trained to, and the
rest of the gap is where the places fall.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import torch

from cluster.drafts.head_data import Text, extract_features, held_out_prompts
from cluster.drafts.head_ttt import unrolled_logits
from cluster.drafts.prune import load_target
from cluster.engine.llm import LLM, user_prompt_text
from cluster.models.eagle3 import Eagle3Head, load_head
from cluster.models.loader import resolve_model
from cluster.models.shipped_heads import resolve_head
from cluster.shared.sampling_params import SamplingParams

SPAN = 64  # answer tokens per span of the per-span figures


@dataclass
class PlaceReport:
    engine_drafts: int
    engine_accepted: int
    every_place: int
    every_place_hits: int
    replayed_places: int
    replayed_hits: int
    hit_after_hit: float  # P(hit at place t + 1 | hit at t), over every place
    hit_after_miss: float
    span_rates: list[float]  # acceptance at every place of answer tokens [i * SPAN, (i + 1) * SPAN)
    requests_matching: int  # requests whose engine hits equal their replayed hits
    requests: int

    def rates(self) -> dict[str, float]:
        return {"engine": self.engine_accepted / max(self.engine_drafts, 1),
                "every place": self.every_place_hits / max(self.every_place, 1),
                "replayed k = 1 places": self.replayed_hits / max(self.replayed_places, 1)}


def replay_k1(hits: list[bool]) -> tuple[int, int]:
    """(places, hits) of a one-token drafter over ``hits`` (hit at answer place ``t``): it starts at
    place 0; a hit moves it two places on, a miss one."""
    places = found = t = 0
    while t < len(hits):
        places += 1
        found += hits[t]
        t += 2 if hits[t] else 1
    return places, found


def place_hits(head: Eagle3Head, embed: torch.nn.Embedding, text: Text, aux: torch.Tensor) -> list[bool]:
    """Per answer place, whether the head's first draft is the text's next-but-one token: place ``t``
    reads the target's states at ``prompt_len - 1 + t`` and the token after it, as the engine's
    first proposal after the prompt does."""
    tokens = torch.tensor(text.token_ids)[None]
    logits = unrolled_logits(head, embed, aux[None].float(), tokens, 1)[0][0]
    drafted = logits.argmax(-1)
    drafted = (drafted + head.d2t[drafted]).tolist()
    ids = text.token_ids
    return [drafted[u] == ids[u + 2] for u in range(text.prompt_len - 1, len(ids) - 2)]


@torch.no_grad()
def measure(target: str, head_name: str, prompts: list[str | list[int]], max_tokens: int,
            dtype: str = "bfloat16", **engine_overrides) -> PlaceReport:
    """``prompts``: user messages (put through the chat template) or token ids."""
    llm = LLM(model=target, dtype=dtype, method="eagle3", draft_model=head_name, num_speculative_tokens=1,
              controller="fixed", **engine_overrides)
    try:
        outputs = llm.generate([user_prompt_text(llm.tokenizer, p) if isinstance(p, str) else p for p in prompts],
                               SamplingParams(max_tokens=max_tokens, temperature=0.0))
    finally:
        llm.engine.worker.close()
    texts = [Text(list(o.prompt_token_ids) + list(o.outputs[0].token_ids), len(o.prompt_token_ids)) for o in outputs]
    model = load_target(resolve_model(target))
    head = load_head(resolve_head(head_name), model.config.num_hidden_layers).float().eval()
    embed = torch.nn.Embedding.from_pretrained(model.get_input_embeddings().weight.detach().float(), freeze=True)
    features = extract_features(model.to(getattr(torch, dtype)), texts, head.config.aux_layer_ids, None)
    report = PlaceReport(0, 0, 0, 0, 0, 0, 0.0, 0.0, [], 0, len(texts))
    pairs = {True: [0, 0], False: [0, 0]}  # previous place hit? -> [hits, places]
    spans: list[list[int]] = []
    for output, text, aux in zip(outputs, texts, features.aux):
        counts = output.spec_decode
        report.engine_drafts += counts.num_draft_tokens
        report.engine_accepted += counts.num_accepted_tokens
        hits = place_hits(head, embed, text, aux)
        report.every_place += len(hits)
        report.every_place_hits += sum(hits)
        places, found = replay_k1(hits[: max_tokens - 2])  # the engine drafts while two tokens are left
        report.replayed_places += places
        report.replayed_hits += found
        report.requests_matching += found == counts.num_accepted_tokens
        for before, now in zip(hits, hits[1:]):
            pairs[before][0] += now
            pairs[before][1] += 1
        for t, hit in enumerate(hits):
            while len(spans) <= t // SPAN:
                spans.append([0, 0])
            spans[t // SPAN][0] += hit
            spans[t // SPAN][1] += 1
    report.hit_after_hit = pairs[True][0] / max(pairs[True][1], 1)
    report.hit_after_miss = pairs[False][0] / max(pairs[False][1], 1)
    report.span_rates = [h / n for h, n in spans]
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--head", default="smollm2-135m-instruct-eagle3")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = held_out_prompts()
    report = measure(args.target, args.head, prompts, args.max_tokens, args.dtype, max_num_seqs=len(prompts),
                     num_threads=args.threads)
    print(f"{report.requests} prompts x {args.max_tokens} greedy tokens, k = 1, {args.dtype}")
    for name, rate in report.rates().items():
        print(f"  first drafts accepted, {name:<22} {rate:6.1%}")
    print(f"  P(hit | hit at the place before) {report.hit_after_hit:6.1%}, "
          f"P(hit | miss) {report.hit_after_miss:6.1%}")
    print("  every place per span of " + str(SPAN) + " answer tokens: "
          + ", ".join(f"{r:.1%}" for r in report.span_rates))
    print(f"  requests whose engine hits equal the replayed hits: {report.requests_matching} / {report.requests}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), **asdict(report), "rates": report.rates()}, f, indent=1)


if __name__ == "__main__":
    main()
