"""What ``tandem bench served`` reads from a server itself around a cell, beside its client's
figures: the engine core's step timeline (``/debug/timeline``, Tandem only) and the counters of
``/metrics`` that Tandem and vLLM both publish (preemptions, drafts, draft tokens accepted)."""

from __future__ import annotations

import json
import urllib.request

from cluster.metrics.exposition import sample_total


def read_timeline(url: str, seconds: float) -> dict | None:
    """The engine core's step summary over the last ``seconds`` (the cell just run)."""
    try:
        with urllib.request.urlopen(f"{url}/debug/timeline?last_seconds={seconds:.3f}", timeout=30) as response:
            groups = json.loads(response.read())
    except OSError:
        return None
    first = next(iter(groups.values()), {})
    return first.get("summary")


# Counters a cell reads before and after it runs, by the names Tandem and vLLM both publish.
COUNTERS = {"num_preemptions": "vllm:num_preemptions_total", "num_drafts": "vllm:spec_decode_num_drafts_total",
            "num_draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
            "num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total"}


def read_counters(url: str) -> dict[str, float] | None:
    """The server's :data:`COUNTERS`, each summed over its replicas (those it has not published yet
    left out); None where the page cannot be read."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
            exposition = response.read().decode()
    except OSError:
        return None
    totals = {key: sample_total(exposition, name) for key, name in COUNTERS.items()}
    return {key: value for key, value in totals.items() if value is not None}


def counter_figures(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float]:
    """What a cell added to each counter (one the server first published during the cell started at
    0), and the speculation's acceptance rate (accepted / drafted tokens) and mean acceptance length
    (1 + accepted / drafts) where it drafted; nothing where either page could not be read."""
    if before is None or after is None:
        return {}
    out = {key: value - before.get(key, 0.0) for key, value in after.items()}
    if out.get("num_draft_tokens"):
        out["acceptance_rate"] = out["num_accepted_tokens"] / out["num_draft_tokens"]
    if out.get("num_drafts"):
        out["mean_acceptance_length"] = 1 + out["num_accepted_tokens"] / out["num_drafts"]
    return out
