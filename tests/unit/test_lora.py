"""LoRA adapters served beside their base model: outputs equal PEFT's (the library that makes the
adapters), requests of different adapters and of the base model share a batch, an adapter's KV
blocks are never another's prefix-cache hit, and adapters that cannot be served are refused by name."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster.engine.llm import LLM
from cluster.models.lora import LoRAError
from cluster.shared.sampling_params import SamplingParams
from tests.lora_helpers import peft_model, reference_greedy, save_peft_adapter

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {"all": save_peft_adapter(tiny_llama_dir, root / "all", seed=1),
            "qv": save_peft_adapter(tiny_llama_dir, root / "qv", seed=2, targets=["q_proj", "v_proj"], rank=8,
                                    alpha=16, rslora=True)}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 23, 40)]


@pytest.fixture(scope="module")
def references(tiny_llama_dir, adapters):
    from transformers import AutoModelForCausalLM

    prompts = _prompts()
    expected = {name: reference_greedy(peft_model(tiny_llama_dir, path), prompts, MAX_TOKENS)
                for name, path in adapters.items()}
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    expected[None] = reference_greedy(base, prompts, MAX_TOKENS)
    assert expected["all"] != expected[None] and expected["qv"] != expected[None]  # the adapters change the output
    return prompts, expected


@pytest.mark.parametrize("overrides", [{}, {"max_num_batched_tokens": 16, "num_blocks": 24}],
                         ids=["whole", "chunked-and-preempted"])
def test_mixed_batches_match_peft(tiny_llama_dir, adapters, references, overrides):
    """Every prompt under each adapter and under none, all in one batch: PEFT's greedy tokens."""
    prompts, expected = references
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_blocks=overrides.get("num_blocks", 128),
              lora_modules={name: str(path) for name, path in adapters.items()},
              **{k: v for k, v in overrides.items() if k != "num_blocks"})
    # Interleaved, so the runner reorders each step's requests by adapter.
    names = [name for _ in prompts for name in ("qv", None, "all")]
    outs = llm.generate([p for p in prompts for _ in range(3)],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True), lora=names)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [expected[name][i] for i in range(len(prompts)) for name in ("qv", None, "all")]
    llm.engine.check_invariants()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.pool.num_blocks


def test_speculative_decoding_keeps_the_adapters_output(tiny_llama_dir, noisy_draft_dir, adapters, references):
    """A draft model proposes without the adapter; the target verifies with it: PEFT's tokens still."""
    prompts, expected = references
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_blocks=128,
              lora_modules={"all": str(adapters["all"])}, method="draft", draft_model=str(noisy_draft_dir),
              num_speculative_tokens=3)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True), lora="all")
    assert [o.outputs[0].token_ids for o in outs] == expected["all"]


def test_an_adapters_blocks_are_not_the_base_models_cache_hits(tiny_llama_dir, adapters):
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_blocks=64,
              lora_modules={"all": str(adapters["all"])})
    prompt = list(range(3, 3 + 48))
    params = SamplingParams(max_tokens=2, temperature=0)
    llm.generate([prompt], params)
    assert llm.generate([prompt], params, lora="all")[0].usage.cached_tokens == 0
    assert llm.generate([prompt], params, lora="all")[0].usage.cached_tokens == 32  # its own blocks are
    assert llm.generate([prompt], params)[0].usage.cached_tokens == 32


def test_an_unknown_adapter_is_refused_by_name(tiny_llama_dir, adapters):
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_blocks=16,
              lora_modules={"all": str(adapters["all"])})
    with pytest.raises(ValueError, match="no LoRA adapter 'other'.*adapters: all"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2), lora="other")


def _edited(adapter, tmp_path, settings=None, tensors=None):
    folder = tmp_path / "edited"
    folder.mkdir()
    config = json.loads((adapter / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **(settings or {})}))
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    save_file(tensors(weights) if tensors else weights, str(folder / "adapter_model.safetensors"))
    return folder


@pytest.mark.parametrize("settings, tensors, words", [
    ({"use_dora": True}, None, "use_dora"),
    ({"r": 128}, None, "max_lora_rank"),
    ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    (None, lambda w: {k: v for k, v in w.items() if "lora_B" not in k}, "without its pair"),
    (None, lambda w: {**w, "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}, "lm_head"),
    (None, lambda w: {k: v[:, :8].contiguous() if "lora_A" in k else v for k, v in w.items()}, "needs A"),
])
def test_adapters_that_cannot_be_served_are_refused_by_name(tiny_llama_dir, adapters, tmp_path, settings, tensors,
                                                            words):
    folder = _edited(adapters["all"], tmp_path, settings, tensors)
    with pytest.raises(LoRAError, match=words):
        LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_blocks=16, lora_modules={"bad": str(folder)})


def test_lora_settings_are_checked(tiny_llama_dir, tiny_opt_dir, adapters):
    from cluster.config import ConfigError

    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        LLM(str(tiny_llama_dir), lora_modules={"all": str(adapters["all"])}, tensor_parallel_size=2)
    with pytest.raises(LoRAError, match="Llama-family"):
        LLM(str(tiny_opt_dir), device="cpu", num_blocks=16, lora_modules={"all": str(adapters["all"])})


@pytest.mark.parametrize("slots, counts", [([1, 0, 2, 1], [2, 1, 3, 1]), ([0, 1, 1, 3], [1, 2, 1, 3]),
                                           ([2, 0, 2], [1, 4, 2]), ([0, 3, 0], [2, 2, 3])],
                         ids=["apart", "ordered-skipping-a-slot", "one-adapter-apart", "one-run"])
def test_every_token_gets_its_own_adapters_update(slots, counts):
    """Any layout of a step's tokens (the runner orders them by adapter; other callers may not):
    each row gets its own adapter's update or none, whether the step is one adapter's run of rows
    or mixes adapters (then masked) or is a CUDA graph's step over the whole reserved stacks
    (``LoRABatch.static``); a projection an adapter does not target (slot 2 here) is left alone
    for its rows."""
    from cluster.models.lora import LoRABatch, LoRALinear, LoRAState

    torch.manual_seed(0)
    base = torch.nn.Linear(6, 5)
    state = LoRAState([], torch.device("cpu"), torch.float32)
    layer = LoRALinear(base, [3, 2], 6, [9, 9], state)
    state.modules.append({"proj": layer})
    ranks = {1: 2, 3: 4}
    updates = {slot: (torch.randn(r, 6), torch.randn(3, r), torch.randn(2, r)) for slot, r in ranks.items()}
    for slot, (a, b0, b1) in updates.items():  # the same A for both parts: rows 0-1 and 2-3 of the stack
        layer.add(slot, {0: (a, b0), 1: (a, b1)}, "cpu", torch.float32)
    batch = LoRABatch.from_token_slots(slots, counts, torch.device("cpu"))
    assert (batch.run is None) == (len([s for s in slots if s]) > 1)
    x = torch.randn(sum(counts), 6)
    state.batch = batch
    got = layer(x)
    token_slots = [s for s, c in zip(slots, counts) for _ in range(c)]
    state.reserve()  # 9 rows, 6 of them used: the other 3 are zero and belong to no slot
    assert layer.parts[0].a.shape == (9, 6) and layer.parts[0].column_slots.tolist()[6:] == [-1] * 3
    state.batch = LoRABatch.static(torch.tensor(token_slots))
    got_static = layer(x)
    state.batch = None
    expected = base(x)
    for row, slot in enumerate(token_slots):
        if slot in updates:
            a, b0, b1 = updates[slot]
            expected[row] += torch.cat([b0 @ a @ x[row], b1 @ a @ x[row]])
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_static, expected)


def test_a_step_of_one_adapters_run_is_sliced_and_a_step_without_adapters_is_none():
    from cluster.models.lora import LoRABatch

    ordered = LoRABatch.from_token_slots([0, 1, 1, 0], [1, 2, 0, 3], torch.device("cpu"))
    assert (ordered.run, ordered.present, ordered.num_tokens) == ((1, slice(1, 3)), (1,), 6)
    mixed = LoRABatch.from_token_slots([0, 1, 2], [1, 2, 3], torch.device("cpu"))
    assert mixed.run is None and mixed.present == (1, 2) and mixed.token_slots.tolist() == [0, 1, 1, 2, 2, 2]
    assert LoRABatch.from_token_slots([0, 0], [3, 1], torch.device("cpu")) is None


def test_projections_with_the_same_columns_for_other_adapters_do_not_share_a_mask():
    """Two projections of one step where different adapters sit in the same columns (one adapter
    targets only the first, another only the second): each keeps its own adapter's update."""
    from cluster.models.lora import LoRABatch, LoRALinear, LoRAState

    torch.manual_seed(1)
    state = LoRAState([], torch.device("cpu"), torch.float32)
    first, second = (LoRALinear(torch.nn.Linear(4, 3), [3], 4, [9], state)
                     for _ in range(2))
    a1, b1, a2, b2, a3, b3 = torch.randn(2, 4), torch.randn(3, 2), torch.randn(2, 4), torch.randn(3, 2), \
        torch.randn(2, 4), torch.randn(3, 2)
    first.add(1, {0: (a1, b1)}, "cpu", torch.float32)
    first.add(3, {0: (a3, b3)}, "cpu", torch.float32)
    second.add(2, {0: (a2, b2)}, "cpu", torch.float32)
    second.add(3, {0: (a3, b3)}, "cpu", torch.float32)
    state.batch = LoRABatch.from_token_slots([1, 2, 3], [1, 1, 1], torch.device("cpu"))
    x = torch.randn(3, 4)
    got_first, got_second = first(x), second(x)
    state.batch = None
    torch.testing.assert_close(got_first, first.base(x) + torch.stack([b1 @ a1 @ x[0], x.new_zeros(3), b3 @ a3 @ x[2]]))
    torch.testing.assert_close(got_second, second.base(x) + torch.stack([x.new_zeros(3), b2 @ a2 @ x[1],
                                                                         b3 @ a3 @ x[2]]))


@pytest.mark.parametrize("reserved", [False, True], ids=["grown", "reserved"])
def test_an_adapter_removed_leaves_the_others_columns_right(reserved):
    """Slots 1, 2, 3 stacked, 2 removed, 4 added after: rows of 1, 3 and 4 in one mixed step each get
    their own update, whether the step mixes them (masked) or is one adapter's run (sliced) or,
    with the stacks reserved first (they never move then), a CUDA graph's step over every row."""
    from cluster.models.lora import LoRABatch, LoRALinear, LoRAState

    torch.manual_seed(2)
    state = LoRAState([], torch.device("cpu"), torch.float32)
    layer = LoRALinear(torch.nn.Linear(4, 5), [3, 2], 4, [8, 8], state)
    state.modules.append({"proj": layer})
    if reserved:
        state.reserve()
    first = layer.parts[0].a
    updates = {slot: (torch.randn(r, 4), torch.randn(3, r), torch.randn(2, r)) for slot, r in ((1, 2), (2, 3), (3, 1))}
    for slot, (a, b0, b1) in updates.items():
        layer.add(slot, {0: (a, b0), 1: (a, b1)}, "cpu", torch.float32)
    layer.remove(2)
    del updates[2]
    updates[4] = (torch.randn(2, 4), torch.randn(3, 2), torch.randn(2, 2))
    layer.add(4, {0: updates[4][:2], 1: (updates[4][0], updates[4][2])}, "cpu", torch.float32)
    part = layer.parts[0]
    assert part.columns == {1: (0, 2), 3: (2, 3), 4: (3, 5)} and part.used == 5
    assert part.a.shape == ((8, 4) if reserved else (6, 4))  # grown to the most it held, 6 rows
    if reserved:  # the rows a graph's step reads past the adapters: zero and no one's
        assert part.column_slots.tolist()[5:] == [-1] * 3 and not part.a[5:].any() and not part.bt[5:].any()
    assert (part.a is first) == reserved
    forms = ["eager", "static"] if reserved else ["eager"]
    for slots, form in itertools.product(([1, 0, 3, 4], [0, 3]), forms):
        x = torch.randn(len(slots), 4)
        state.batch = (LoRABatch.from_token_slots(slots, [1] * len(slots), torch.device("cpu")) if form == "eager"
                       else LoRABatch.static(torch.tensor(slots)))
        got = layer(x)
        state.batch = None
        expected = layer.base(x)
        for row, slot in enumerate(slots):
            if slot:
                a, b0, b1 = updates[slot]
                expected[row] += torch.cat([b0 @ a @ x[row], b1 @ a @ x[row]])
        torch.testing.assert_close(got, expected)


def test_a_stack_refuses_more_rows_than_its_capacity():
    from cluster.models.lora_stack import PartStack

    part = PartStack(0, 3, 4, capacity=4)
    part.add(1, torch.randn(3, 4), torch.randn(3, 3))
    with pytest.raises(ValueError, match="needs 2 rows; 1 of 4 are free"):
        part.add(2, torch.randn(2, 4), torch.randn(3, 2))
    part.reserve(torch.device("cpu"), torch.float32)
    with pytest.raises(RuntimeError, match="never reallocates"):
        part._allocate(8, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("removed", [1, 2, 3], ids=["first-overlapping", "middle", "last"])
def test_a_stack_keeps_the_others_rows_whichever_adapter_leaves(removed):
    """Ranks 1, 3, 2: removing the first moves 5 rows up by 1 (over their own old place), the
    second moves 2 rows up by 3, the last moves nothing; the rows left equal the others' A and B."""
    from cluster.models.lora_stack import PartStack

    torch.manual_seed(3)
    part = PartStack(0, 3, 4, capacity=6)
    weights = {slot: (torch.randn(rank, 4), torch.randn(3, rank)) for slot, rank in ((1, 1), (2, 3), (3, 2))}
    for slot, (a, b) in weights.items():
        part.add(slot, a, b)
    part.remove(removed)
    kept = [slot for slot in weights if slot != removed]
    assert part.used == sum(weights[slot][0].shape[0] for slot in kept)
    torch.testing.assert_close(part.a[:part.used], torch.cat([weights[slot][0] for slot in kept]))
    torch.testing.assert_close(part.bt[:part.used], torch.cat([weights[slot][1].t() for slot in kept]))
    assert part.column_slots[:part.used].tolist() == [slot for slot in kept for _ in range(weights[slot][0].shape[0])]
    for slot in kept:
        start, end = part.columns[slot]
        torch.testing.assert_close(part.a[start:end], weights[slot][0])


def test_adapters_coming_and_going_at_random_keep_every_rows_update():
    """200 random loads (ranks 1-4, on one part or both) and unloads within the room, the stacks
    reserved a third of the way in: after each, a step of random rows (each loaded adapter or none)
    gets each row's own update, eagerly and, once reserved, through the static form too; the
    reserved tensors never move."""
    import random

    from cluster.models.lora import LoRABatch, LoRALinear, LoRAState

    rng = random.Random(5)
    torch.manual_seed(5)
    state = LoRAState([], torch.device("cpu"), torch.float32)
    layer = LoRALinear(torch.nn.Linear(4, 5), [3, 2], 4, [12, 12], state)
    state.modules.append({"proj": layer})
    live: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}  # slot -> part -> (A, B)
    next_slot, reserved_a = 1, None
    for step in range(200):
        if step == 66:
            state.reserve()
            reserved_a = layer.a
        used = [sum(p[part][0].shape[0] for p in live.values() if part in p) for part in (0, 1)]
        rank, targets = rng.randint(1, 4), rng.choice([(0,), (1,), (0, 1)])
        if live and (rng.random() < 0.45 or any(used[part] + rank > 12 for part in targets)):
            slot = rng.choice(sorted(live))
            layer.remove(slot)
            del live[slot]
        else:
            a = torch.randn(rank, 4)
            parts = {part: (a, torch.randn((3, 2)[part], rank)) for part in targets}
            layer.add(next_slot, parts, "cpu", torch.float32)
            live[next_slot], next_slot = parts, next_slot + 1
        slots = [rng.choice([0, *live]) for _ in range(6)]
        x = torch.randn(len(slots), 4)
        expected = layer.base(x)
        for row, slot in enumerate(slots):
            for part, (a, b) in live.get(slot, {}).items():
                expected[row, (0, 3)[part]:(3, 5)[part]] += b @ a @ x[row]
        batches = [LoRABatch.from_token_slots(slots, [1] * len(slots), torch.device("cpu"))]
        if reserved_a is not None:
            batches.append(LoRABatch.static(torch.tensor(slots)))
        for batch in batches:
            state.batch = batch
            got = layer(x)
            state.batch = None
            torch.testing.assert_close(got, expected, msg=f"step {step}, slots {slots}")
    assert reserved_a is not None and layer.a is reserved_a and next_slot > 60
