"""The `tandem` command on the embedded default model."""

from __future__ import annotations

import pytest

from cluster.cli import main

pytestmark = pytest.mark.slow


def test_generate_prints_a_completion(capsys):
    assert main(["generate", "The capital of France is", "--max-tokens", "8", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "Paris" in out


def test_generate_chat_applies_the_template(capsys):
    assert main(["generate", "--chat", "What is the capital of France?", "--max-tokens", "16"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_unknown_model_is_an_error_not_a_traceback(capsys):
    assert main(["generate", "--model", "no-such-model", "hi"]) == 2
    assert "smollm2-135m-instruct" in capsys.readouterr().err
