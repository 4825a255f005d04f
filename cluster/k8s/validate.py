"""Offline validation of Kubernetes manifests, as strict as ``kubectl apply`` with
server-side field validation, plus Tandem's own checks of what a RayService runs.

Per document, by ``apiVersion`` and ``kind``:

- ``ray.io/v1`` RayService and RayCluster: KubeRay's CRD schema (``k8s/schemas/kuberay/``,
  vendored), *closed* the way the API server's strict field validation treats it
  (an unknown field is an error unless the schema preserves unknown fields); every pod
  template again as a core ``PodTemplate``; and for a RayService, ``serveConfigV2``
  must be a Serve config whose applications run ``deployments.app:app_builder`` on an
  inline config that :func:`cluster.config.config_from_dict` accepts, whose model and
  profile paths lie on a volume every Ray container mounts;
- ``monitoring.coreos.com/v1`` PodMonitor, ServiceMonitor and PrometheusRule: prometheus-operator's
  CRD schemas (``k8s/schemas/prometheus-operator/``, vendored), closed the same way, and a monitor
  must list at least one endpoint (one with none scrapes nothing);
- anything else: the core schemas of ``kubernetes-validate`` in strict mode; a kind no
  schema knows is an error, not a pass.

Every problem is a :class:`ManifestError` naming the file, the document, the object and
the field.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import jsonschema
import yaml
from jsonschema.exceptions import best_match

from cluster.config import ConfigError, config_from_dict
from cluster.k8s.rayservice import APP_IMPORT_PATH
from cluster.k8s.render import check_paths_on_volume

KUBERNETES_VERSION = "1.37.0"
SCHEMA_DIR = Path(__file__).resolve().parents[2] / "k8s" / "schemas"
CRD_FILES = {  # folder under SCHEMA_DIR -> the CRDs vendored there
    "kuberay": ("ray.io_rayservices.yaml", "ray.io_rayclusters.yaml"),
    "prometheus-operator": ("monitoring.coreos.com_podmonitors.yaml", "monitoring.coreos.com_servicemonitors.yaml",
                            "monitoring.coreos.com_prometheusrules.yaml"),
}
MONITOR_ENDPOINTS = {"PodMonitor": "podMetricsEndpoints", "ServiceMonitor": "endpoints"}
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when present: the CRDs are 1 MB each
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class ManifestError(ValueError):
    """A manifest is invalid; the message names the file, the object and the field."""


def closed(schema: dict) -> dict:
    """A copy of an OpenAPI v3 CRD schema in which objects reject fields they do not list.

    Objects with ``additionalProperties`` or ``x-kubernetes-preserve-unknown-fields``, and
    objects that list no properties (free maps), stay open.
    """
    schema = copy.deepcopy(schema)
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if ("properties" in node and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
            node["additionalProperties"] = False
        for key in ("properties", "patternProperties"):
            stack.extend(node.get(key, {}).values())
        for key in ("items", "additionalProperties", "not"):
            stack.append(node.get(key))
        for key in ("allOf", "anyOf", "oneOf"):
            stack.extend(node.get(key, []))
    return schema


def _crd_schemas(schema_dir: Path) -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> closed schema, for every served version of the CRDs vendored under ``schema_dir``."""
    schemas = {}
    for folder, names in CRD_FILES.items():
        for name in names:
            path = schema_dir / folder / name
            if not path.is_file():
                raise ManifestError(f"CRD {path} is missing; it is vendored under k8s/schemas/{folder}/")
            crd = yaml.load(path.read_text(), Loader=_LOADER)
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                if version.get("served"):
                    schemas[(f"{group}/{version['name']}", kind)] = closed(version["schema"]["openAPIV3Schema"])
    return schemas


def _where(error: jsonschema.ValidationError) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "(top level)"


class ManifestValidator:
    """Validates manifests offline; holds the loaded CRD schemas (build it once, use it often)."""

    def __init__(self, schema_dir: str | Path, kubernetes_version: str = KUBERNETES_VERSION) -> None:
        self.crd_schemas = _crd_schemas(Path(schema_dir))
        self.kubernetes_version = kubernetes_version

    @classmethod
    def from_repo(cls) -> "ManifestValidator":
        """With the CRDs vendored in this checkout (``k8s/schemas/``)."""
        return cls(SCHEMA_DIR)

    # ---- files ----------------------------------------------------------------------
    def validate_paths(self, paths: list[str | Path]) -> int:
        """Validate YAML files and every ``*.yaml``/``*.yml`` under directories; returns the document count."""
        files: list[Path] = []
        for path in map(Path, paths):
            if path.is_dir():
                files.extend(sorted(p for p in path.rglob("*") if p.suffix in (".yaml", ".yml")
                                    and not _kustomize_file(p)))
            elif path.is_file():
                files.append(path)
            else:
                raise ManifestError(f"{path} does not exist")
        return sum(self.validate_file(f) for f in files)

    def validate_file(self, path: str | Path) -> int:
        """Validate every document of one YAML file; returns how many there were."""
        try:
            documents = [d for d in yaml.load_all(Path(path).read_text(), Loader=_LOADER) if d is not None]
        except yaml.YAMLError as err:
            raise ManifestError(f"{path}: not valid YAML: {err}") from None
        for index, document in enumerate(documents):
            self.validate_document(document, f"{path} (document {index + 1})")
        return len(documents)

    # ---- documents ------------------------------------------------------------------
    def validate_document(self, document: object, where: str = "manifest") -> None:
        """ManifestError unless ``document`` is valid; ``where`` starts the message (file, document)."""
        if not isinstance(document, dict):
            raise ManifestError(f"{where}: a manifest is a mapping, got {type(document).__name__}")
        api_version, kind = document.get("apiVersion"), document.get("kind")
        metadata = document.get("metadata")
        name = metadata.get("name") if isinstance(metadata, dict) else None
        if not isinstance(api_version, str) or not isinstance(kind, str) or not isinstance(name, str):
            raise ManifestError(f"{where}: apiVersion, kind and metadata.name are required strings")
        where = f"{where}: {kind} {name}"
        if len(name) > 253 or not _NAME.match(name):
            raise ManifestError(f"{where}: metadata.name must be lowercase letters, digits, '-' and '.'")
        key = (api_version, kind)
        if key in self.crd_schemas:
            self._check_schema(document, self.crd_schemas[key], where)
            if api_version.startswith("ray.io/"):
                self._check_ray_object(document, where)
            elif kind in MONITOR_ENDPOINTS and not document["spec"].get(MONITOR_ENDPOINTS[kind]):
                raise ManifestError(f"{where}: spec.{MONITOR_ENDPOINTS[kind]} is empty: the monitor scrapes nothing")
        else:
            self._check_core(document, where)

    def _check_schema(self, document: dict, schema: dict, where: str) -> None:
        error = best_match(jsonschema.Draft7Validator(schema).iter_errors(document))
        if error is not None:
            raise ManifestError(f"{where}: {_where(error)}: {error.message}")

    def _check_core(self, document: dict, where: str) -> None:
        # here, not at the top: kubernetes-validate is optional (the test extra)
        try:
            import kubernetes_validate
        except ImportError:
            raise ManifestError("validating core Kubernetes objects needs kubernetes-validate: "
                                "pip install -e '.[test]'") from None
        try:
            kubernetes_validate.validate(document, self.kubernetes_version, strict=True)
        except kubernetes_validate.ValidationError as err:
            raise ManifestError(f"{where}: {_where(err)}: {err.message}") from None
        except kubernetes_validate.SchemaNotFoundError as err:
            raise ManifestError(f"{where}: no schema knows this kind: {err.message}") from None

    def _check_ray_object(self, document: dict, where: str) -> None:
        spec = document.get("spec") or {}
        cluster = (spec.get("rayClusterConfig") or {}) if document["kind"] == "RayService" else spec
        if "headGroupSpec" not in cluster:
            raise ManifestError(f"{where}: the Ray cluster needs a headGroupSpec")
        groups = [("headGroupSpec", cluster["headGroupSpec"])] + [
            (f"workerGroupSpecs[{g.get('groupName')}]", g) for g in cluster.get("workerGroupSpecs", [])]
        for label, group in groups:
            pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "template"},
                            "template": group["template"]}
            self._check_core(pod_template, f"{where}: {label}.template")
        if document["kind"] == "RayService":
            mounts = [_lasting_mounts(group["template"]["spec"]) for _, group in groups]
            check_serve_config(spec.get("serveConfigV2"), mounts, f"{where}: serveConfigV2")


def _lasting_mounts(pod_spec: dict) -> list[str]:
    """Mount paths of the Ray container's volumes that outlive the pod (not emptyDir)."""
    scratch = {v["name"] for v in pod_spec.get("volumes", []) if "emptyDir" in v}
    return [m["mountPath"] for m in pod_spec["containers"][0].get("volumeMounts", []) if m["name"] not in scratch]


def check_serve_config(text: object, mounts_per_group: list[list[str]], where: str) -> None:
    """ManifestError unless ``text`` is a Serve config of Tandem applications whose model and
    profile paths lie on a volume that every Ray container mounts (``mounts_per_group``)."""
    if not isinstance(text, str):
        raise ManifestError(f"{where}: required, a Serve config (YAML) as a string")
    try:
        serve = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ManifestError(f"{where}: not valid YAML: {err}") from None
    apps = serve.get("applications") if isinstance(serve, dict) else None
    if not isinstance(apps, list) or not apps:
        raise ManifestError(f"{where}: 'applications' must list at least one application")
    for app in apps:
        app_where = f"{where}: application {app.get('name')!r}" if isinstance(app, dict) else where
        if not isinstance(app, dict) or app.get("import_path") != APP_IMPORT_PATH:
            raise ManifestError(f"{app_where}: import_path must be {APP_IMPORT_PATH}")
        config = (app.get("args") or {}).get("config")
        if not isinstance(config, dict):
            raise ManifestError(f"{app_where}: args.config must be the Tandem config inline (a mapping)")
        if "kubernetes" in config:
            raise ManifestError(f"{app_where}: args.config must not carry the kubernetes section")
        shared = [m for m in mounts_per_group[0] if all(m in mounts for mounts in mounts_per_group)]
        try:
            check_paths_on_volume(config_from_dict(config, "args.config"), shared)
        except ConfigError as err:
            raise ManifestError(f"{app_where}: {err}") from None


def _kustomize_file(path: Path) -> bool:
    """A kustomization, or a file of a kustomize directory that is not one of its resources (a patch):
    neither is a manifest (``kubectl kustomize`` builds the manifests they make)."""
    if path.name == "kustomization.yaml":
        return True
    kustomization = path.parent / "kustomization.yaml"
    if not kustomization.is_file():
        return False
    resources = (yaml.safe_load(kustomization.read_text()) or {}).get("resources", [])
    return path.name not in resources
