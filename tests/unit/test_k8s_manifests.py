"""Every YAML manifest under k8s/ is valid, and the rendered ones are what the generator renders now.

Validation is offline: core kinds against kubernetes-validate's strict schemas, RayService
against KubeRay's vendored CRD (closed like the API server's strict field validation),
monitors and alert rules against prometheus-operator's vendored CRDs, and the Tandem config inside the RayService
against our pydantic config. No Ray, no cluster.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from cluster.config import config_from_dict
from cluster.config_k8s import KubernetesConfig
from cluster.k8s.render import read_config, render
from cluster.k8s.validate import ManifestValidator

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
# Rendered directory -> the config it comes from (and the spelling in its header).
RENDERED = {"single-gpu": "configs/gpu-single.yaml", "hetero-gpu": "configs/hetero-gpu.yaml"}
MANIFESTS = sorted(p for p in K8S.rglob("*") if p.suffix in (".yaml", ".yml"))


@pytest.fixture(scope="module")
def validator() -> ManifestValidator:
    return ManifestValidator.from_repo()


def test_the_manifests_to_check_are_there():
    names = {p.relative_to(K8S).as_posix() for p in MANIFESTS}
    for directory in RENDERED:
        assert {f"{directory}/rayservice.yaml", f"{directory}/monitoring.yaml", f"{directory}/namespace.yaml"} <= names
    assert {"schemas/kuberay/ray.io_rayservices.yaml", "schemas/kuberay/ray.io_rayclusters.yaml"} <= names
    assert (K8S / "schemas" / "kuberay" / "SOURCE.md").is_file()


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.relative_to(K8S).as_posix())
def test_every_manifest_under_k8s_is_valid(validator, path):
    assert validator.validate_file(path) >= 1


@pytest.mark.parametrize("directory", sorted(RENDERED))
def test_committed_manifests_equal_what_the_config_renders(directory):
    source = RENDERED[directory]
    config, embedded = read_config(ROOT / source)
    files = render(config, embedded, source)
    out = K8S / directory
    for name, text in files.items():
        assert (out / name).is_file(), f"k8s/{directory}/{name} is missing: run tandem k8s render {source} " \
                                       f"--out k8s/{directory}"
        assert (out / name).read_text() == text, f"k8s/{directory}/{name} is stale: run tandem k8s render " \
                                                 f"{source} --out k8s/{directory}"
    extra = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.yaml"))
    assert extra == sorted(files), "files in the directory that the config does not render"


@pytest.mark.parametrize("directory", sorted(RENDERED))
def test_the_rayservice_embeds_the_config_without_the_kubernetes_section(directory):
    config, embedded = read_config(ROOT / RENDERED[directory])
    service = yaml.safe_load((K8S / directory / "rayservice.yaml").read_text())
    serve = yaml.safe_load(service["spec"]["serveConfigV2"])
    (app,) = serve["applications"]
    assert app["import_path"] == "deployments.app:app_builder"
    assert "kubernetes" not in app["args"]["config"]
    raw = yaml.safe_load((ROOT / RENDERED[directory]).read_text())
    expected = {k: v for k, v in raw.items() if k != "kubernetes"}
    expected["serve"] = expected["serve"] | {"ingress_num_replicas": 2, "ingress_max_replicas_per_node": 1,
                                             "log_format": "json"}  # Kubernetes' defaults
    if expected["serve"].pop("api_key_env", None):  # the keys' Secret, mounted as a file
        expected["serve"]["api_key_file"] = "/etc/tandem/api-keys/api-key"
    assert embedded == expected
    # The bounds live in the deployments: section (updated in place), the rest in args.
    bounds = {d["name"]: d for d in app["deployments"]}
    for group in config.serve.groups:
        entry = bounds[f"replica-{group.name}"]
        if group.autoscaling is not None:
            assert entry["autoscaling_config"]["max_replicas"] == group.autoscaling.max_replicas
        else:
            assert entry["num_replicas"] == group.num_replicas
    assert bounds["ingress"]["num_replicas"] == 2
    served = config_from_dict(app["args"]["config"], "args").serve
    assert [g.name for g in served.groups] == [g.name for g in config.serve.groups]
    assert all(g.autoscaling is None or g.autoscaling.max_replicas == 1 for g in served.groups)


@pytest.mark.parametrize("directory", sorted(RENDERED))
def test_worker_groups_follow_the_serve_groups(directory):
    config, _ = read_config(ROOT / RENDERED[directory])
    service = yaml.safe_load((K8S / directory / "rayservice.yaml").read_text())
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert head["rayStartParams"]["metrics-export-port"] == str(config.serve.metrics_export_port)
    workers = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert list(workers) == [g.name for g in config.serve.groups]
    for group in config.serve.groups:
        worker = workers[group.name]
        container = worker["template"]["spec"]["containers"][0]
        assert worker["resources"] == {f"accelerator_type:{group.accelerator_type}": "1"}
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= group.tensor_parallel_size * group.num_gpus
        # The weights read-only, shared memory, the API keys' Secret (re-read when rotated), and Ray's
        # temp folder, which the ray-logs sidecar reads (its JSON lines to the sidecar's stdout).
        assert {m["mountPath"]: m.get("readOnly", False) for m in container["volumeMounts"]} == {
            "/models": True, "/dev/shm": False, "/etc/tandem/api-keys": True, "/tmp/ray": False}
        sidecar = worker["template"]["spec"]["containers"][1]
        assert sidecar["name"] == "ray-logs" and sidecar["image"] == container["image"]
        assert sidecar["command"][:3] == ["python", "-m", "cluster.shared.log_follow"]
        assert sidecar["volumeMounts"] == [{"name": "ray-tmp", "mountPath": "/tmp/ray", "readOnly": True}]
        assert not any("secretKeyRef" in str(e) for e in container["env"])  # no key fixed at the pod's start
        assert container["readinessProbe"]["httpGet"]["path"] == "/-/healthz"
        assert 1 <= worker["maxReplicas"] and worker["minReplicas"] <= worker["maxReplicas"]


def test_image_ray_and_manifests_agree_on_the_ray_version():
    version = re.search(r'"ray\[serve\]==([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    base = re.search(r"^FROM rayproject/ray:(\S+)", (K8S / "Dockerfile").read_text(), re.MULTILINE)
    assert base and base.group(1).split("-")[0] == version
    assert KubernetesConfig().ray_version == version
    for directory in RENDERED:
        service = yaml.safe_load((K8S / directory / "rayservice.yaml").read_text())
        assert service["spec"]["rayClusterConfig"]["rayVersion"] == version


def test_vendored_crds_are_the_shared_ones_when_shared_is_beside_the_repo():
    shared = ROOT.parent / "shared" / "schemas" / "kuberay"
    if not shared.is_dir():
        pytest.skip("../shared/schemas/kuberay is not beside this checkout")
    for name in ("ray.io_rayservices.yaml", "ray.io_rayclusters.yaml"):
        assert (K8S / "schemas" / "kuberay" / name).read_bytes() == (shared / name).read_bytes()
