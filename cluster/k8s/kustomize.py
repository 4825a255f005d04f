"""``tandem k8s render --kustomize``: the same manifests as a kustomize base, and an overlay with a
patch point for every pod of the Ray cluster, so site changes the config does not model
(imagePullSecrets, a serviceAccountName, affinity, pod annotations, extra env, a runtimeClassName)
live in an overlay that survives rendering again.

The RayService is a custom resource, so kustomize cannot merge into its pod lists by name; the
overlay's patches are JSON 6902 operations on each pod template's path (the head's, and each
worker group's by its index, which follows the config's ``serve.groups``). ``profile/`` (the
profiling Jobs, applied on their own) stays beside the base. Rendering again rewrites ``base/``
and leaves an existing overlay alone.
"""

from __future__ import annotations

import yaml

from cluster.config import TandemConfig

OVERLAY = "overlays/site"
_HEADER = "# Written by `tandem k8s render --kustomize`."


def kustomize_files(config: TandemConfig, files: dict[str, str]) -> dict[str, str]:
    """``files`` (a plain render) as base/ and profile/, and the overlay's files."""
    out = {(name if name.startswith("profile/") else f"base/{name}"): text for name, text in files.items()}
    resources = sorted(name for name in files if not name.startswith("profile/"))
    out["base/kustomization.yaml"] = _dump({"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                                            "resources": resources}, f"{_HEADER} Rewritten on every render.")
    out.update(overlay_files(config))
    return out


def pod_paths(config: TandemConfig) -> dict[str, str]:
    """Each Ray pod's name in the overlay -> the JSON pointer of its pod template in the RayService."""
    paths = {"head": "/spec/rayClusterConfig/headGroupSpec/template"}
    for index, group in enumerate(config.serve.groups):
        paths[group.name] = f"/spec/rayClusterConfig/workerGroupSpecs/{index}/template"
    return paths


def overlay_files(config: TandemConfig) -> dict[str, str]:
    """The overlay: the base, and one patch of every pod template that annotates it with the
    overlay's name (a working example to edit; the comments list the usual pod fields)."""
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                     "resources": ["../../base"],
                     "patches": [{"path": "pods.yaml", "target": {
                         "group": "ray.io", "version": "v1", "kind": "RayService", "name": config.kubernetes.name}}]}
    operations = []
    lines = [f"{_HEADER} Yours to edit: rendering again leaves it alone.",
             "# JSON 6902 operations on the RayService's pod templates; for each pod, e.g.:"]
    for pod, path in pod_paths(config).items():
        operations.append({"op": "add", "path": f"{path}/metadata/annotations",
                           "value": {"tandem/overlay": "site"}})
        lines += [f"#   {pod}: {path}/spec/serviceAccountName, .../spec/imagePullSecrets, .../spec/affinity,",
                  "#         .../spec/runtimeClassName, .../spec/priorityClassName, .../spec/containers/0/env/-"]
    return {f"{OVERLAY}/kustomization.yaml": _dump(kustomization, f"{_HEADER} Yours to edit."),
            f"{OVERLAY}/pods.yaml": "\n".join(lines) + "\n" + yaml.safe_dump(operations, sort_keys=False)}


def _dump(document: dict, header: str) -> str:
    return header + "\n" + yaml.safe_dump(document, sort_keys=False)
