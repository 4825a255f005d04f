"""The serve section of the config (replica groups) and what is built from it.

Checks that the shipped YAML files load, that a group's engine settings are the
shared ones plus its overrides and profile (``group_engine_config``), that invalid
serve settings fail with a message naming the key, and that the Ray Serve options
of each group (``deployments.app.replica_options``) and the local CPU count
(``deployments.local.logical_cpus_needed``) follow the config. No Ray cluster is
started: ``build_app`` only binds deployments.
"""

from __future__ import annotations

from pathlib import Path

import subprocess
import sys

import pytest

from cluster.config import ConfigError, config_from_dict, group_engine_config, load_config
from deployments.app import build_app, replica_options
from deployments.local import logical_cpus_needed

ROOT = Path(__file__).resolve().parents[2]
HETERO = ROOT / "configs" / "hetero-gpu.yaml"
LOCAL = ROOT / "configs" / "local.yaml"


def serve_config(*groups: dict, **serve):
    """A config whose serve section has ``groups`` (dicts) and the ``serve`` keys."""
    return config_from_dict({"serve": {**serve, "groups": list(groups)}}, "test")


def adaptive_config(*groups: dict, profile: str | None = None, controller: str = "adaptive"):
    """A config with a controller that reads profiles (adaptive, or table)."""
    speculative = {"method": "ngram", "controller": controller}
    if profile is not None:
        speculative["profile"] = profile
    return config_from_dict({"speculative": speculative, "serve": {"groups": list(groups)}}, "test")


def group_of(config, name: str):
    return next(g for g in config.serve.groups if g.name == name)


# ---- shipped files -----------------------------------------------------------------
def test_hetero_gpu_yaml_groups_get_their_own_engine_settings():
    config = load_config(HETERO)
    assert [g.name for g in config.serve.groups] == ["h100", "a10g"]
    expected = {"h100": ("40GiB", 256, "/models/profiles/h100-tp2.json"),
                "a10g": ("6GiB", 48, "/models/profiles/a10g-tp1.json")}
    for name, (kv_memory, max_num_seqs, profile) in expected.items():
        engine = group_engine_config(config, name)
        assert engine.cache.kv_cache_memory == kv_memory
        assert engine.scheduler.max_num_seqs == max_num_seqs
        assert engine.speculative.profile == profile
        # Shared settings are kept, and only this group remains (without overrides).
        assert engine.scheduler.max_num_batched_tokens == 8192
        assert engine.model.dtype == "bfloat16"
        assert [g.name for g in engine.serve.groups] == [name]
        assert engine.serve.groups[0].engine == {}
    # The shared config itself is unchanged.
    assert config.scheduler.max_num_seqs == 128
    assert config.speculative.profile is None
    assert group_of(config, "h100").engine["max_num_seqs"] == 256


def test_shipped_gpu_groups_run_vllm_with_settings_vllm_accepts():
    from cluster.backends.vllm_args import vllm_settings

    for path in (ROOT / "configs" / "gpu-single.yaml", HETERO):
        config = load_config(path)
        for group in config.serve.groups:
            engine = group_engine_config(config, group.name)
            assert (group.name, engine.engine.backend) == (group.name, "vllm")
            # Tandem's own int8 schemes would be refused here (cluster/backends/vllm_args.py).
            settings = vllm_settings(engine, group.tensor_parallel_size, engine.model.model,
                                     engine.speculative.draft_model, None, True)
            assert settings.engine_args["speculative_config"]["method"] == "draft_model"
            assert settings.engine_args["kv_cache_memory_bytes"] == engine.cache.memory_bytes()
    a10g = group_engine_config(load_config(HETERO), "a10g")
    assert a10g.model.quantization == "none" and a10g.engine.vllm_args == {"quantization": "fp8"}


def test_unknown_group_name_is_named():
    config = load_config(HETERO)
    with pytest.raises(ConfigError, match="'t4'"):
        group_engine_config(config, "t4")


def test_local_yaml_has_one_default_group():
    config = load_config(LOCAL)
    assert len(config.serve.groups) == 1
    group = config.serve.groups[0]
    assert (group.name, group.device_kind, group.num_replicas, group.autoscaling) == ("default", "cpu", 1, None)
    assert group_engine_config(config, "default").scheduler.max_num_seqs == config.scheduler.max_num_seqs


def test_group_profile_is_found_next_to_the_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("serve:\n  groups:\n    - name: cpu\n      profile: profiles/p.json\n")
    config = load_config(path)
    assert config.serve.groups[0].profile == str((tmp_path / "profiles" / "p.json").resolve())


# ---- validation errors -------------------------------------------------------------
@pytest.mark.parametrize("groups, message", [
    ([{"name": "a"}, {"name": "a"}], "names must be unique"),
    ([{"name": "a", "autoscaling": {"min_replicas": 3, "max_replicas": 2}}], "serve.groups.0.autoscaling"),
    ([{"name": "a", "autoscaling": {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 5}}],
     "initial_replicas must lie in"),
    ([{"name": "a", "autoscaling": {"min_replicas": 2, "max_replicas": 4, "initial_replicas": 1}}],
     "initial_replicas must lie in"),
    ([{"name": "a", "step_time_scale": 0.5}], "serve.groups.0.step_time_scale"),
    ([{"name": "a", "num_replica": 2}], "unknown key 'serve.groups.0.num_replica'"),
    ([{"name": "a"}, {"name": "b", "autoscaling": {"max_replica": 2}}],
     "unknown key 'serve.groups.1.autoscaling.max_replica'"),
    ([{"name": "Bad Name"}], "serve.groups.0.name"),
    ([], "serve.groups"),
])
def test_bad_serve_settings_name_the_key(groups, message):
    with pytest.raises(ConfigError, match=message):
        serve_config(*groups)


def test_autoscaling_bounds_that_fit_are_accepted():
    config = serve_config({"name": "a", "autoscaling": {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 4}})
    assert config.serve.groups[0].autoscaling.initial_replicas == 4


def test_bad_group_engine_override_names_the_group():
    with pytest.raises(ConfigError, match=r"serve\.groups\[b\]\.engine: unknown setting 'max_num_seqz'"):
        serve_config({"name": "a"}, {"name": "b", "engine": {"max_num_seqz": 3}})
    with pytest.raises(ConfigError, match=r"serve\.groups\[a\]\.engine: .*scheduler\.max_num_seqs"):
        serve_config({"name": "a", "engine": {"max_num_seqs": "lots"}})


def test_the_table_controller_needs_a_profile_in_every_group_and_adaptive_none():
    with pytest.raises(ConfigError, match="missing in: b"):
        adaptive_config({"name": "a", "profile": "/p/a.json"}, {"name": "b"}, controller="table")
    config = adaptive_config({"name": "a", "profile": "/p/a.json"}, {"name": "b"})  # b starts from the prior
    assert group_engine_config(config, "b").speculative.profile is None
    config = adaptive_config({"name": "a", "profile": "/p/a.json"}, {"name": "b", "profile": "/p/b.json"})
    assert group_engine_config(config, "b").speculative.profile == "/p/b.json"
    # A shared profile covers every group; a group's own one still wins.
    config = adaptive_config({"name": "a"}, {"name": "b", "profile": "/p/b.json"}, profile="/p/shared.json")
    assert group_engine_config(config, "a").speculative.profile == "/p/shared.json"
    assert group_engine_config(config, "b").speculative.profile == "/p/b.json"


# ---- Ray Serve options -------------------------------------------------------------
def options_of(group: dict, **serve) -> dict:
    config = serve_config(group, **serve)
    return replica_options(config, config.serve.groups[0])


def test_fixed_size_group_has_num_replicas_and_no_autoscaling():
    options = options_of({"name": "a", "num_replicas": 3, "num_cpus": 2})
    assert options["num_replicas"] == 3
    assert "autoscaling_config" not in options
    assert options["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 0.0}
    assert "placement_group_bundles" not in options


def test_serve_waits_the_drain_time_for_a_stopping_replicas_requests():
    assert options_of({"name": "a"})["graceful_shutdown_timeout_s"] == 30
    assert options_of({"name": "a"}, drain_timeout_s=90)["graceful_shutdown_timeout_s"] == 90


def test_autoscaling_group_passes_its_bounds_through():
    options = options_of({"name": "a", "autoscaling": {"min_replicas": 2, "max_replicas": 5,
                                                      "initial_replicas": 3, "target_ongoing_requests": 12}})
    assert "num_replicas" not in options
    scaling = options["autoscaling_config"]
    assert (scaling.min_replicas, scaling.max_replicas, scaling.initial_replicas) == (2, 5, 3)
    assert scaling.target_ongoing_requests == 12


def test_accelerator_and_tensor_parallel_bundles():
    options = options_of({"name": "a", "accelerator_type": "H100", "num_gpus": 1, "num_cpus": 4,
                          "tensor_parallel_size": 4, "placement_strategy": "PACK"})
    assert options["ray_actor_options"]["accelerator_type"] == "H100"
    assert options["placement_group_bundles"] == [{"CPU": 4.0, "GPU": 1.0}] * 4
    assert options["placement_group_strategy"] == "PACK"


def test_router_config_only_for_the_tandem_router():
    options = options_of({"name": "a"}, router="tandem", routing_staleness_s=7.0, routing_stats_period_s=0.25)
    router = options["request_router_config"]
    assert router.request_router_class.endswith("TandemRequestRouter")
    assert router.request_router_kwargs == {"staleness_seconds": 7.0}
    assert router.request_routing_stats_period_s == 0.25
    assert "request_router_config" not in options_of({"name": "a"}, router="pow2")


def test_max_queued_requests_and_ongoing_are_passed_through():
    options = options_of({"name": "a", "max_ongoing_requests": 17}, max_queued_requests=99)
    assert (options["max_queued_requests"], options["max_ongoing_requests"]) == (99, 17)
    assert options_of({"name": "a"})["max_queued_requests"] == -1


def test_build_app_takes_tensor_parallel_groups_and_refuses_a_conflicting_engine_setting():
    ingress = build_app(serve_config({"name": "a"}, {"name": "b", "tensor_parallel_size": 2}))._bound_deployment
    assert set(ingress.init_args[1]) == {"a", "b"}
    config = serve_config({"name": "a", "tensor_parallel_size": 2})
    config.parallel.tensor_parallel_size = 4
    with pytest.raises(ConfigError, match=r"parallel\.tensor_parallel_size is 4 but serve\.groups\[a\]"):
        build_app(config)


def test_build_app_binds_one_replica_deployment_per_group_without_ray():
    config = serve_config({"name": "a"}, {"name": "b"})
    ingress = build_app(config)._bound_deployment  # Ray's Application keeps the bound deployment here
    assert ingress.name == "ingress"
    replicas = ingress.init_args[1]
    assert {group: (app._bound_deployment.name, app._bound_deployment.init_args[1])
            for group, app in replicas.items()} == {"a": ("replica-a", "a"), "b": ("replica-b", "b")}


def test_build_app_does_not_start_ray():
    # In a fresh interpreter: other tests in this session may have started Ray themselves.
    script = (
        "import ray\n"
        "from deployments.app import build_app\n"
        f"build_app({str(LOCAL)!r})\n"
        "print(ray.is_initialized())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_logical_cpus_count_max_replicas_of_autoscaling_groups():
    config = serve_config(
        {"name": "a", "num_replicas": 2, "num_cpus": 1.5},
        {"name": "b", "num_replicas": 9, "num_cpus": 1, "autoscaling": {"min_replicas": 1, "max_replicas": 4}},
        {"name": "c", "num_cpus": 2, "tensor_parallel_size": 2},
        ingress_num_cpus=0.5,
    )
    # a: 2 * 1.5, b: max 4 (not num_replicas 9) * 1, c: 1 replica * 2 ranks * 2, ingress, driver.
    assert logical_cpus_needed(config) == pytest.approx(3 + 4 + 4 + 0.5 + 1)
    assert logical_cpus_needed(load_config(HETERO)) == pytest.approx(8 * 2 * 4 + 16 * 4 + 0.5 + 1)
