"""`tandem bench served` gives vLLM the dtype the served config computes in on this machine, and its context length."""

from __future__ import annotations

import pytest
import torch
import yaml

from cluster.bench.served import tandem_dtype
from cluster.kernels.packed_linear import onednn_packs


def _config(tmp_path, model_dir, dtype: str, group_engine: dict | None = None):
    group = {"name": "default", "device_kind": "cpu", "num_cpus": 2}
    if group_engine:
        group["engine"] = group_engine
    path = tmp_path / "served.yaml"
    path.write_text(yaml.safe_dump({"model": {"model": str(model_dir), "dtype": dtype},
                                    "serve": {"groups": [group]}}))
    return path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_named_dtype_is_passed_on(tmp_path, tiny_llama_dir, dtype):
    assert tandem_dtype(_config(tmp_path, tiny_llama_dir, dtype)) == dtype


def test_auto_is_made_concrete_for_this_cpu(tmp_path, tiny_llama_dir):
    expected = "bfloat16" if onednn_packs(torch.bfloat16) else "float32"
    assert tandem_dtype(_config(tmp_path, tiny_llama_dir, "auto")) == expected


def test_the_served_group_overrides_the_shared_dtype(tmp_path, tiny_llama_dir):
    path = _config(tmp_path, tiny_llama_dir, "bfloat16", group_engine={"dtype": "float32"})
    assert tandem_dtype(path) == "float32"


def test_the_served_groups_max_model_len_is_passed_on(tmp_path, tiny_llama_dir):
    from cluster.bench.served import tandem_max_model_len

    path = _config(tmp_path, tiny_llama_dir, "float32", group_engine={"max_model_len": 300})
    assert tandem_max_model_len(path) == 300
