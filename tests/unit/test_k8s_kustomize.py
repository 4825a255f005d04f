"""``tandem k8s render --kustomize``: ``kubectl kustomize`` builds the overlay into manifests that
validate as the plain render does, every Ray pod template patched, and an edited overlay
survives rendering again."""

from __future__ import annotations

import copy
import shutil
import subprocess

import pytest
import yaml

from cluster.cli import main
from cluster.k8s.validate import ManifestValidator

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its kustomize) is not installed")


def _build(overlay) -> list[dict]:
    done = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def _pods(service: dict) -> list[dict]:
    cluster = service["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]


def test_the_overlay_builds_valid_manifests_with_every_pod_patched(tmp_path):
    out = tmp_path / "hetero"
    assert main(["k8s", "render", "configs/hetero-gpu.yaml", "--out", str(out), "--kustomize"]) == 0
    built = _build(out / "overlays" / "site")
    validator = ManifestValidator.from_repo()
    for document in built:
        validator.validate_document(document, document["kind"])
    assert {d["kind"] for d in built} >= {"Namespace", "RayService", "NetworkPolicy", "PodMonitor", "PrometheusRule",
                                          "PodDisruptionBudget"}
    [service] = [d for d in built if d["kind"] == "RayService"]
    [base] = [d for d in yaml.safe_load_all((out / "base" / "rayservice.yaml").read_text()) if d]
    assert len(_pods(service)) == 3 and all(p["metadata"]["annotations"] == {"tandem/overlay": "site"}
                                            for p in _pods(service))
    unpatched = copy.deepcopy(service)
    for pod in _pods(unpatched):
        del pod["metadata"]["annotations"]
    assert unpatched == base  # the overlay changes nothing else

    # An edited overlay is the operator's: rendering again rewrites base/ and keeps it.
    patch = out / "overlays" / "site" / "pods.yaml"
    patch.write_text(patch.read_text() + yaml.safe_dump([{
        "op": "add", "path": "/spec/rayClusterConfig/workerGroupSpecs/0/template/spec/serviceAccountName",
        "value": "gpu-nodes"}]))
    edited = patch.read_text()
    assert main(["k8s", "render", "configs/hetero-gpu.yaml", "--out", str(out), "--kustomize"]) == 0
    assert patch.read_text() == edited
    [service] = [d for d in _build(out / "overlays" / "site") if d["kind"] == "RayService"]
    assert service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["serviceAccountName"] \
        == "gpu-nodes"
    assert main(["k8s", "validate", str(out)]) == 0  # the kustomize files are skipped, the manifests checked
