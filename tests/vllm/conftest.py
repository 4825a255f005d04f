"""The vLLM tier: one Tandem cluster on loopback with a ``native`` and a ``vllm`` replica
group serving the embedded default model (SmolLM2-135M-Instruct, float32, n-gram
speculation), in vLLM's CPU build's environment (``make test-vllm``).

Every test here is skipped, with the reason printed (``pytest -rs``), when vLLM cannot be
imported: ``TANDEM_VLLM_UNAVAILABLE`` carries why its environment could not be built.
"""

from __future__ import annotations

import os
import socket

import pytest

from tests.serve.conftest import API_KEY, MODEL

GROUPS = ("native", "vllm")


def _vllm_missing() -> str | None:
    reason = os.environ.get("TANDEM_VLLM_UNAVAILABLE")
    if reason:
        return reason
    try:
        import vllm
    except ImportError as err:
        vllm, missing = None, str(err)
    else:  # pytest puts tests/ on sys.path, where this folder is a namespace package named vllm
        missing = None if getattr(vllm, "__file__", None) else "only tests/vllm itself is found"
    if missing:
        return f"vLLM is not importable in this interpreter ({missing}); `make test-vllm` builds its environment"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _vllm_missing()
    if reason is None:
        return
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.skip(reason=f"vLLM tier: {reason}"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def serve_config():
    from cluster.config import config_from_dict

    return config_from_dict({
        "model": {"model": "smollm2-135m-instruct", "dtype": "float32", "max_model_len": 256},
        "cache": {"kv_cache_memory": "64MiB"},
        "scheduler": {"max_num_seqs": 16},
        "device": {"device": "cpu", "num_threads": 1},
        "speculative": {"method": "ngram", "num_speculative_tokens": 3},
        # No compilation: the engine starts in about a minute on this CPU.
        "engine": {"vllm_args": {"enforce_eager": True}},
        "serve": {
            "port": _free_port(), "metrics_export_port": _free_port(),
            "served_model_name": MODEL, "api_key": API_KEY,
            "groups": [
                {"name": "native", "num_cpus": 0.5},
                {"name": "vllm", "num_cpus": 0.5, "engine": "vllm"},
            ],
        },
    })


@pytest.fixture(scope="session")
def server_url(serve_config):
    import ray
    from ray import serve

    from deployments.local import start_local

    url = start_local(serve_config, app_name="tandem-vllm-test", blocking=False)
    yield url
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(params=GROUPS)
def group(request) -> str:
    return request.param


@pytest.fixture()
def client(server_url, group):
    """An OpenAI client whose requests are all served by one group (X-Tandem-Group)."""
    import openai

    return openai.OpenAI(base_url=f"{server_url}/v1", api_key=API_KEY, max_retries=0, timeout=300,
                         default_headers={"X-Tandem-Group": group})
