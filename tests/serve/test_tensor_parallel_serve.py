"""A replica group with ``tensor_parallel_size`` 2 on a real local Ray Serve: the replica is
rank 0 and a Ray actor in its placement group is rank 1. It serves the tokens one rank
computes, and when the rank actor is killed the next request fails at once with an
OpenAI-shaped 500 and the replica turns unhealthy.

The server runs in a fresh interpreter with its own Ray (``tp_serve_probe``), so it
neither meets nor disturbs the session's shared server.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.engine.llm import LLM
from cluster.shared.sampling_params import SamplingParams
from tests.serve.tp_serve_probe import MAX_TOKENS, PROMPT

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # starts its own Ray: about a minute
def test_tp2_group_serves_and_fails_fast_when_a_rank_dies(tiny_chat_model, tmp_path):
    out = tmp_path / "facts.json"
    subprocess.run([sys.executable, "-m", "tests.serve.tp_serve_probe", str(tiny_chat_model), str(out)],
                   cwd=ROOT, timeout=600, check=True)
    facts = json.loads(out.read_text())

    llm = LLM(str(tiny_chat_model), device="cpu", dtype="float32", num_blocks=32, block_size=8)
    expected = llm.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0].outputs[0].text
    assert facts["first"]["status"] == 200
    assert facts["first"]["body"]["choices"][0]["text"] == expected
    assert len(facts["rank_actors"]) == 1

    after = facts["after_kill"]
    assert after["status"] == 500
    assert "tensor-parallel rank 1 exited" in after["body"]["error"]["message"]
    assert facts["status_before"].endswith("HEALTHY") and facts["status_after"] != facts["status_before"]
