"""``tandem k8s render``: the kubernetes section, worker group sizing, clear errors, and a
serve config that Ray Serve's own schema and Tandem's app builder accept (no Ray started)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from cluster.cli import main
from cluster.config import ConfigError, config_from_dict, load_config, with_overrides
from cluster.k8s.plan import plan_worker_groups
from cluster.k8s.render import read_config, render

ROOT = Path(__file__).resolve().parents[2]
SINGLE = ROOT / "configs" / "gpu-single.yaml"
HETERO = ROOT / "configs" / "hetero-gpu.yaml"


def _group(name: str, **fields) -> dict:
    base = {"name": name, "device_kind": name.upper(), "accelerator_type": name.upper(), "num_gpus": 1,
            "num_cpus": 4, "autoscaling": {"min_replicas": 2, "max_replicas": 8}}
    return base | fields


def _config(groups: list[dict], kubernetes: dict | None = None):
    data = {"model": {"model": "/models/target"}, "serve": {"groups": groups}}
    if kubernetes is not None:
        data["kubernetes"] = kubernetes
    return config_from_dict(data)


def test_a_pod_takes_a_node_and_holds_the_replicas_that_fit():
    config = _config([_group("h100", tensor_parallel_size=2)],
                     {"groups": {"h100": {"gpus_per_node": 8}}})
    (plan,) = plan_worker_groups(config)
    assert (plan.gpus_per_pod, plan.replicas_per_pod) == (8, 4)
    assert (plan.min_pods, plan.initial_pods, plan.max_pods) == (1, 1, 2)  # 2..8 replicas, 4 per pod
    assert plan.cpus_per_pod == 4 * 2 * 4 + 2  # replicas x TP x num_cpus, plus headroom
    assert plan.node_selector == {"nvidia.com/gpu.product": "NVIDIA-H100"}
    assert plan.tolerations == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def test_by_default_a_pod_holds_one_replica_and_cpus_can_limit_it():
    (plan,) = plan_worker_groups(_config([_group("a10g", num_replicas=3, autoscaling=None)]))
    assert (plan.gpus_per_pod, plan.replicas_per_pod, plan.min_pods, plan.max_pods) == (1, 1, 3, 3)
    config = _config([_group("a10g", num_gpus=0.5)], {"groups": {"a10g": {"gpus_per_node": 4, "cpu": "12"}}})
    (plan,) = plan_worker_groups(config)
    assert plan.replicas_per_pod == 3  # 8 fit by GPUs, 3 by CPUs
    assert (plan.min_pods, plan.max_pods) == (1, 3)


def test_a_cpu_group_gets_no_gpu_selector_or_toleration():
    (plan,) = plan_worker_groups(_config([_group("cpu", num_gpus=0, accelerator_type=None)]))
    assert (plan.gpus_per_pod, plan.node_selector, plan.tolerations) == (0, {}, [])


@pytest.mark.parametrize("groups, kubernetes, message", [
    ([_group("h100", tensor_parallel_size=2)], {"groups": {"h100": {"gpus_per_node": 1}}},
     "kubernetes.groups.h100.gpus_per_node is 1 but one replica"),
    ([_group("a10g")], {"groups": {"a100": {}}}, "kubernetes.groups has a100, which are not serve groups"),
    ([_group("cpu", num_gpus=0)], {"groups": {"cpu": {"gpus_per_node": 2}}}, "uses no GPU"),
    ([_group("a10g")], {"groups": {"a10g": {"cpu": "2"}}}, "needs 4 CPUs"),
])
def test_impossible_pod_shapes_are_clear_errors(groups, kubernetes, message):
    with pytest.raises(ConfigError, match=message):
        plan_worker_groups(_config(groups, kubernetes))


def test_the_kubernetes_section_is_strict_and_names_the_key():
    with pytest.raises(ConfigError, match="unknown key 'kubernetes.groups.l4.gpu_per_node'"):
        _config([_group("l4")], {"groups": {"l4": {"gpu_per_node": 1}}})
    with pytest.raises(ConfigError, match="kubernetes.head.memory"):
        _config([_group("l4")], {"head": {"memory": "lots"}})
    with pytest.raises(ConfigError, match="unknown setting 'image'"):
        with_overrides(load_config(SINGLE), image="elsewhere:1")  # not a flat engine setting


def test_models_and_profiles_must_come_from_the_volume(tmp_path):
    data = yaml.safe_load(SINGLE.read_text())
    for key, value, message in [
        (("model", "model"), "smollm2-135m-instruct", "model.model is 'smollm2-135m-instruct'"),
        (("speculative", "draft_model"), "drafts/llama-1b", "speculative.draft_model"),
        (("model", "model"), "/models-other/llama", "under /models"),
        (("model", "lora_dir"), "adapters", "model.lora_dir is 'adapters'"),
    ]:
        broken = copy.deepcopy(data)
        broken[key[0]][key[1]] = value
        path = tmp_path / "broken.yaml"
        path.write_text(yaml.safe_dump(broken))
        with pytest.raises(ConfigError, match=message):
            read_config(path)
    broken = copy.deepcopy(data)
    broken["serve"]["groups"][0]["profile"] = "profiles/l4.json"  # relative: beside the file on this machine only
    path.write_text(yaml.safe_dump(broken))
    with pytest.raises(ConfigError, match=r"serve.groups\[l4\].profile"):
        read_config(path)
    broken = copy.deepcopy(data)
    broken["serve"]["groups"][0]["engine"] = {"lora_modules": {"sql": "/tmp/sql-lora"}}
    path.write_text(yaml.safe_dump(broken))
    with pytest.raises(ConfigError, match=r"serve.groups\[l4\].engine.lora_modules.sql is '/tmp/sql-lora'"):
        read_config(path)


def test_a_config_without_a_kubernetes_section_renders_with_defaults(tmp_path):
    data = yaml.safe_load(Path(HETERO).read_text())
    del data["kubernetes"]
    bare = tmp_path / "hetero-bare.yaml"
    bare.write_text(yaml.safe_dump(data))
    config, embedded = read_config(bare)
    files = render(config, embedded, "configs/hetero-gpu.yaml")
    service = yaml.safe_load(files["rayservice.yaml"])
    workers = {g["groupName"]: g for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert (workers["h100"]["minReplicas"], workers["h100"]["maxReplicas"]) == (2, 8)  # one TP-2 replica per pod
    assert workers["h100"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert sorted(f for f in files if f.startswith("profile/")) == [
        "profile/configmap.yaml", "profile/job-a10g.yaml", "profile/job-h100.yaml"]
    job = yaml.safe_load(files["profile/job-h100.yaml"])
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[-4:] == ["--group", "h100", "--out", "/models/profiles/h100-tp2.json"]


def test_the_serve_config_is_one_ray_serve_and_tandem_accept():
    from ray.serve.schema import ServeDeploySchema  # the schema only; no Ray is started

    from deployments.app import app_builder

    config, embedded = read_config(SINGLE)
    service = yaml.safe_load(render(config, embedded, "x")["rayservice.yaml"])
    serve = ServeDeploySchema.model_validate(yaml.safe_load(service["spec"]["serveConfigV2"]))
    (app,) = serve.applications
    assert (app.import_path, app.route_prefix, serve.http_options.port) == ("deployments.app:app_builder", "/", 8000)
    ingress = app_builder(app.args)._bound_deployment  # binds the deployments; Ray stays down
    assert ingress.name == "ingress"
    replicas = ingress.init_args[1]
    assert list(replicas) == ["l4"]


def test_app_builder_errors_are_clear():
    from deployments.app import app_builder

    with pytest.raises(ConfigError, match="args.config: unknown key 'modle'"):
        app_builder({"config": {"modle": {}}})
    with pytest.raises(ConfigError, match="a YAML file's path or a mapping of sections, got list"):
        app_builder({"config": ["model"]})
    hetero = read_config(HETERO)[1]
    app_builder({"config": hetero})  # its h100 group is tensor-parallel
    with pytest.raises(ConfigError, match=r"parallel\.tensor_parallel_size is 4 but serve\.groups\[h100\]"):
        app_builder({"config": {**hetero, "parallel": {"tensor_parallel_size": 4}}})


def test_cli_renders_and_validates(tmp_path, capsys):
    out = tmp_path / "manifests"
    assert main(["k8s", "render", str(SINGLE), "--out", str(out)]) == 0
    assert (out / "rayservice.yaml").is_file() and (out / "profile" / "job-l4.yaml").is_file()
    (out / "old.yaml").write_text("{}")
    assert main(["k8s", "render", str(SINGLE), "--out", str(out)]) == 0
    assert "old.yaml was not rendered from this config" in capsys.readouterr().out
    (out / "old.yaml").unlink()
    assert main(["k8s", "validate", str(out)]) == 0
    assert "9 manifests valid" in capsys.readouterr().out
    assert main(["k8s", "render", str(tmp_path / "missing.yaml"), "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_each_worker_group_gets_a_disruption_budget_selecting_its_pods():
    config, embedded = read_config(HETERO)
    files = render(config, embedded, "configs/hetero-gpu.yaml")
    budgets = list(yaml.safe_load_all(files["disruption.yaml"]))
    assert [b["metadata"]["name"] for b in budgets] == ["tandem-h100", "tandem-a10g"]
    workers = yaml.safe_load(files["rayservice.yaml"])["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    for budget, worker in zip(budgets, workers):
        assert budget["spec"]["maxUnavailable"] == 1
        pod_labels = worker["template"]["metadata"]["labels"]
        assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    off = config.model_copy(update={"kubernetes": config.kubernetes.model_copy(update={"pod_disruption_budget": False})})
    assert "disruption.yaml" not in render(off, embedded, "x")


def test_the_ingress_gets_two_replicas_on_kubernetes_and_fewer_are_refused(tmp_path):
    _, embedded = read_config(HETERO)
    assert embedded["serve"]["ingress_num_replicas"] == 2
    assert load_config(HETERO).serve.ingress_num_replicas is None  # `tandem serve` keeps one
    for serve_fields, key in (({"ingress_num_replicas": 1}, "ingress_num_replicas"),
                              ({"ingress_autoscaling": {"min_replicas": 1, "max_replicas": 4}},
                               "ingress_autoscaling.min_replicas")):
        data = yaml.safe_load(HETERO.read_text())
        data["serve"].update(serve_fields)
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(data))
        with pytest.raises(ConfigError, match=f"serve.{key} is 1: on Kubernetes the ingress needs at least 2"):
            read_config(path)
    data = yaml.safe_load(HETERO.read_text())
    data["serve"]["ingress_autoscaling"] = {"min_replicas": 2, "max_replicas": 6, "target_ongoing_requests": 512}
    path.write_text(yaml.safe_dump(data))
    _, embedded = read_config(path)
    assert "ingress_num_replicas" not in embedded["serve"]


def test_incremental_upgrades_and_head_fault_tolerance_render_valid_manifests():
    from cluster.k8s.validate import ManifestValidator

    config, embedded = read_config(HETERO)
    assert yaml.safe_load(render(config, embedded, "x")["rayservice.yaml"])["spec"]["upgradeStrategy"] == {
        "type": "NewCluster"}
    k8s = config.kubernetes.model_dump()
    k8s["upgrades"] = {"strategy": "NewClusterWithIncrementalUpgrade", "gateway_class_name": "istio",
                       "step_size_percent": 20}
    k8s["head_fault_tolerance"] = {"redis_address": "redis.tandem.svc:6379", "password_secret": "redis-password"}
    changed = config_from_dict({**embedded, "kubernetes": k8s})
    service = yaml.safe_load(render(changed, embedded, "x")["rayservice.yaml"])
    assert service["spec"]["upgradeStrategy"] == {"type": "NewClusterWithIncrementalUpgrade", "clusterUpgradeOptions": {
        "gatewayClassName": "istio", "intervalSeconds": 60, "stepSizePercent": 20, "maxSurgePercent": 25}}
    assert service["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"] == {
        "redisAddress": "redis.tandem.svc:6379",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "redis-password", "key": "password"}}}}
    ManifestValidator.from_repo().validate_document(service)
    k8s["upgrades"] = {"strategy": "NewClusterWithIncrementalUpgrade"}
    with pytest.raises(ConfigError, match="gateway_class_name is required"):
        config_from_dict({**embedded, "kubernetes": k8s})


def test_pods_get_the_drain_time_and_a_margin_to_stop(tmp_path):
    data = yaml.safe_load(Path(HETERO).read_text())
    data["serve"]["drain_timeout_s"] = 45
    path = tmp_path / "hetero-drain.yaml"
    path.write_text(yaml.safe_dump(data))
    config, embedded = read_config(path)
    service = yaml.safe_load(render(config, embedded, "configs/hetero-gpu.yaml")["rayservice.yaml"])
    cluster = service["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    assert [p["template"]["spec"]["terminationGracePeriodSeconds"] for p in pods] == [75] * len(pods)
    app = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]
    assert app["args"]["config"]["serve"]["drain_timeout_s"] == 45  # the replicas' graceful_shutdown_timeout_s


def test_the_single_gpu_example_keeps_an_ingress_off_its_only_worker():
    """Two ingress replicas, at most one per node, and the head has the CPU for one: draining the
    only GPU worker (whose budget allows it) leaves the head's ingress answering."""
    config, embedded = read_config(Path("configs/gpu-single.yaml"))
    files = render(config, embedded, "configs/gpu-single.yaml")
    service = yaml.safe_load(files["rayservice.yaml"])
    app = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]
    serve = app["args"]["config"]["serve"]
    assert serve["ingress_max_replicas_per_node"] == 1
    assert {d["name"]: d for d in app["deployments"]}["ingress"]["num_replicas"] == 2
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
    assert float(head["num-cpus"]) >= config.serve.ingress_num_cpus > 0
    [budget] = [d for d in yaml.safe_load_all(files["disruption.yaml"]) if d]
    assert budget["spec"]["maxUnavailable"] == 1
    from deployments.app import ingress_options

    assert ingress_options(config_from_dict(embedded, "embedded"))["max_replicas_per_node"] == 1  # what Serve places


def test_inline_api_keys_are_refused_and_ray_is_locked_down(tmp_path):
    data = yaml.safe_load(Path(HETERO).read_text())
    data["serve"]["api_key"] = "sk-inline"
    inline = tmp_path / "inline.yaml"
    inline.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="copied in clear.*api_key_env"):
        read_config(inline)

    config, embedded = read_config(Path(HETERO))
    files = render(config, embedded, "configs/hetero-gpu.yaml")
    cluster = yaml.safe_load(files["rayservice.yaml"])["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token"}  # Ray's dashboard and job API need the token
    policy = yaml.safe_load(files["networkpolicy.yaml"].split("\n", 2)[2])
    rules = policy["spec"]["ingress"]
    ray_pods = policy["spec"]["podSelector"]["matchLabels"]
    assert rules[0] == {"from": [{"podSelector": {"matchLabels": ray_pods}}]}  # the cluster's own pods: all ports
    assert rules[1] == {"ports": [{"protocol": "TCP", "port": 8000}]}  # anyone: the API only
    others = {p["port"] for rule in rules[2:] for p in rule["ports"]}
    assert 8265 in others and all("from" in rule for rule in rules[2:])  # the job API: the operator alone


@pytest.mark.parametrize("change, sidecar", [({}, True), ({"serve": {"log_format": "text"}}, False),
                                             ({"kubernetes": {"logs_sidecar": False}}, False)])
def test_every_ray_pod_gets_the_logs_sidecar_only_for_json_logs(change, sidecar, tmp_path):
    raw = yaml.safe_load(SINGLE.read_text())
    for section, fields in change.items():
        raw.setdefault(section, {}).update(fields)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    config, embedded = read_config(tmp_path / "config.yaml")
    service = yaml.safe_load(render(config, embedded, "x")["rayservice.yaml"])
    cluster = service["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        spec = group["template"]["spec"]
        names = [c["name"] for c in spec["containers"]]
        assert names == (["ray-head" if group is cluster["headGroupSpec"] else "ray-worker", "ray-logs"][:1 + sidecar])
        assert ({"name": "ray-tmp", "emptyDir": {}} in spec["volumes"]) is sidecar
