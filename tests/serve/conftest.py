"""A real Ray Serve cluster on loopback, serving a tiny random-weight model (drafting
for itself) in two replica groups: ``fast`` and ``slow`` (the same CPU, with every
engine step stretched 3x to emulate a slower device); ``fast`` also serves a LoRA adapter and loads
more on demand from a folder of two (``model.lora_dir``, room for one beside the first), and
``slow`` schedules by priority (``scheduler.policy: priority``)."""

from __future__ import annotations

import socket

import pytest

from cluster.config import config_from_dict
from cluster.models.tiny import TINY_CHAT_TEMPLATE, save_tiny_model, save_tiny_tokenizer, tiny_llama_config

API_KEY = "test-key"
MODEL = "tiny-llama"
LORA = "tiny-lora"  # the adapter the fast group serves beside MODEL
DIR_LORAS = ("dir-a", "dir-b")  # the adapters in the fast group's model.lora_dir


def scrape_metrics(where: int | str) -> dict[str, list]:
    """Series name -> samples, from a Prometheus endpoint: a port (Ray's metrics port of this node)
    or a base URL (the API's ``GET /metrics``)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    base = f"http://127.0.0.1:{where}" if isinstance(where, int) else where
    text = httpx.get(f"{base}/metrics", timeout=30).text
    series: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, []).append(sample)
    return series


class ServeProcess:
    """``tandem serve`` run as the command, in a process of its own (its own Ray)."""

    def __init__(self, config: dict, folder, env: dict | None = None, wait: bool = True) -> None:
        """``env``: variables added to the command's environment (and so its Ray's). Ports the
        config does not name are free ones; a port set to None is left to the command's default.
        ``wait``: return once ``/health`` answers 200 (else at once)."""
        import json
        import subprocess
        import sys
        import time

        import httpx

        serve = {"port": free_port(), "proxy_port": free_port(), "metrics_export_port": free_port(),
                 **config.get("serve", {})}
        config = {**config, "serve": {k: v for k, v in serve.items() if v is not None}}
        path = folder / "serve.yaml"
        path.write_text(json.dumps(config))  # JSON is YAML
        self.log = folder / "serve.log"
        self.url = f"http://127.0.0.1:{config['serve']['port']}"
        self.process = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", str(path)],
                                        stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                        env=_own_environment(env))
        deadline = time.time() + 180
        if not wait:
            return
        try:
            while True:
                assert self.process.poll() is None, self.log.read_text()[-3000:]
                try:
                    if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                assert time.time() < deadline, "never ready: " + self.log.read_text()[-3000:]
                time.sleep(0.5)
        except BaseException:
            self.stop()  # the caller gets no handle to stop it with
            raise

    def stop(self) -> None:
        """SIGTERM, as an operator stops it (it then stops the Ray it started); a kill past a minute."""
        import signal
        import subprocess

        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _own_environment(extra: dict | None) -> dict[str, str]:
    """This process's environment without Ray Serve's variables (the session cluster's ``start_local``
    set them here, and they would choose the child's Serve mode over its own config), plus ``extra``."""
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")} | (extra or {})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_chat_llama")
    # 1024 positions: with a character-level tokenizer, tools written into the prompt take room.
    save_tiny_model(tiny_llama_config(max_position_embeddings=1024), path, seed=0)
    save_tiny_tokenizer(path, chat_template=TINY_CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="session")
def tiny_lora(tiny_chat_model, tmp_path_factory):
    """A LoRA adapter of the tiny chat model, served by the ``fast`` group only."""
    from tests.lora_helpers import save_peft_adapter

    return save_peft_adapter(tiny_chat_model, tmp_path_factory.mktemp("tiny_lora"), seed=5)


@pytest.fixture(scope="session")
def tiny_lora_dir(tiny_chat_model, tmp_path_factory):
    """A folder of two adapters of the tiny chat model (DIR_LORAS), the fast group's model.lora_dir."""
    from tests.lora_helpers import save_peft_adapter

    root = tmp_path_factory.mktemp("tiny_lora_dir")
    save_peft_adapter(tiny_chat_model, root / DIR_LORAS[0], seed=6)
    save_peft_adapter(tiny_chat_model, root / DIR_LORAS[1], seed=7, targets=["q_proj", "v_proj"], rank=8)
    return root


@pytest.fixture(scope="session")
def serve_config(tiny_chat_model, tiny_lora, tiny_lora_dir):
    return config_from_dict({
        "model": {"model": str(tiny_chat_model), "max_model_len": 1024},
        "cache": {"num_blocks": 96, "block_size": 16},
        "device": {"device": "cpu", "num_threads": 1},
        # Self-speculation: every draft is accepted, so the speculation metrics have values.
        "speculative": {"method": "draft", "draft_model": str(tiny_chat_model), "num_speculative_tokens": 2},
        "serve": {
            # The proxy gets a port of its own: its default, port + 1, may be some other socket's already.
            "port": free_port(), "proxy_port": free_port(), "metrics_export_port": free_port(),
            "served_model_name": MODEL, "api_key": API_KEY, "log_requests": True,
            "groups": [
                {"name": "fast", "num_cpus": 0.5, "engine": {"lora_modules": {LORA: str(tiny_lora)},
                                                             "lora_dir": str(tiny_lora_dir), "max_loras": 2}},
                {"name": "slow", "num_cpus": 0.5, "step_time_scale": 3.0, "engine": {"policy": "priority"}},
            ],
        },
    })


@pytest.fixture(scope="session")
def server_url(serve_config):
    import ray
    from ray import serve

    from deployments.local import start_local

    url = start_local(serve_config, app_name="tandem-test", blocking=False)
    yield url
    serve.shutdown()
    ray.shutdown()


@pytest.fixture()
def client(server_url):
    import openai

    return openai.OpenAI(base_url=f"{server_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture()
def async_client(server_url):
    import openai

    return openai.AsyncOpenAI(base_url=f"{server_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
