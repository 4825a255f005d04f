"""LoRA adapters through the openai client: a request names an adapter as its model and gets PEFT's
output, the base model's requests beside it keep theirs, only the groups that serve an adapter
receive its requests, and /v1/models lists the adapters under their base model; a group with a
``lora_dir`` loads its adapters on demand, one at a time here (beside the one it keeps)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.lora_helpers import peft_model, reference_greedy
from tests.serve.conftest import DIR_LORAS, LORA, MODEL

PROMPT = [5, 40, 77, 120, 9, 33, 64, 81, 17]
MAX_TOKENS = 10


def test_an_adapter_is_a_model_of_its_own(client, tiny_chat_model, tiny_lora):
    cards = {card.id: card for card in client.models.list().data}
    assert list(cards) == [MODEL, LORA, *DIR_LORAS]
    assert cards[LORA].model_extra["parent"] == MODEL and cards[LORA].model_extra["root"] == str(tiny_lora)
    assert client.models.retrieve(LORA).id == LORA
    base = AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32).eval()
    expected = {LORA: reference_greedy(peft_model(tiny_chat_model, tiny_lora), [PROMPT], MAX_TOKENS)[0],
                MODEL: reference_greedy(base, [PROMPT], MAX_TOKENS)[0]}
    assert expected[LORA] != expected[MODEL]
    for model in (LORA, MODEL, LORA):  # the second adapter request may read the first's cached blocks
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert out.choices[0].model_extra["token_ids"] == expected[model], model
        assert out.model == model
    chunks = list(client.chat.completions.create(model=LORA, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, stream=True))
    assert chunks[-1].choices[0].finish_reason is not None and chunks[0].model == LORA
    response = client.responses.create(model=LORA, input="hi", max_output_tokens=4, temperature=0)
    assert response.model == LORA and response.usage.output_tokens == 4


def test_adapter_requests_go_only_where_the_adapter_is_served(client):
    pinned = client.with_options(default_headers={"X-Tandem-Group": "slow"})
    with pytest.raises(openai.BadRequestError) as err:
        pinned.completions.create(model=LORA, prompt=PROMPT, max_tokens=2)
    assert err.value.body["param"] == "model" and "fast" in err.value.body["message"]
    fast = client.with_options(default_headers={"X-Tandem-Group": "fast"})
    served = fast.completions.create(model=LORA, prompt=PROMPT, max_tokens=2, extra_body={"ignore_eos": True})
    assert served.usage.completion_tokens == 2 and served.model == LORA
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="other-lora", prompt=PROMPT, max_tokens=2)
    assert LORA in err.value.body["message"]


def test_adapters_of_a_lora_dir_load_on_demand(client, tiny_chat_model, tiny_lora_dir):
    """Both adapters of the fast group's folder at once, with room for one beside its own adapter:
    each request gets PEFT's output (one adapter waits for the other's requests, then takes its place)."""
    card = client.models.retrieve(DIR_LORAS[1])
    assert card.model_extra["parent"] == MODEL and card.model_extra["root"] == str(tiny_lora_dir / DIR_LORAS[1])
    expected = {name: reference_greedy(peft_model(tiny_chat_model, tiny_lora_dir / name), [PROMPT], MAX_TOKENS)[0]
                for name in DIR_LORAS}
    assert expected[DIR_LORAS[0]] != expected[DIR_LORAS[1]]
    names = [*DIR_LORAS, *DIR_LORAS]
    with ThreadPoolExecutor(len(names)) as pool:
        outs = list(pool.map(lambda name: client.completions.create(
            model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True}), names))
    for name, out in zip(names, outs):
        assert out.choices[0].model_extra["token_ids"] == expected[name] and out.model == name
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="dir-c", prompt=PROMPT, max_tokens=2)
    assert str(tiny_lora_dir) in err.value.body["message"] and err.value.body["param"] == "model"
    pinned = client.with_options(default_headers={"X-Tandem-Group": "slow"})
    with pytest.raises(openai.BadRequestError) as err:
        pinned.completions.create(model=DIR_LORAS[0], prompt=PROMPT, max_tokens=2)
    assert "fast" in err.value.body["message"]
