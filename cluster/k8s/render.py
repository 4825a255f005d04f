"""``tandem k8s render CONFIG --out DIR``: a Tandem config in, KubeRay manifests out.

Output files, relative to DIR (apply the top level with ``kubectl apply -f DIR``):

- ``namespace.yaml``: the namespace;
- ``rayservice.yaml``: the RayService (Ray cluster, autoscaler, Serve application);
- ``disruption.yaml``: a PodDisruptionBudget per worker group (unless ``kubernetes.pod_disruption_budget`` is false);
- ``alerts.yaml``: a PrometheusRule with Tandem's alerts (``kubernetes.monitoring.alerts``);
- ``monitoring.yaml``: PodMonitors for Prometheus (unless ``kubernetes.monitoring.enabled`` is false);
- ``profile/``: the config as a ConfigMap and one profiling Job per GPU kind (applied on purpose, once).

Rendering is deterministic, so rendered files can be committed and compared. The
inline config must not depend on files outside the cluster: every model, draft model
and profile path must be absolute and lie under ``kubernetes.model_volume.mount_path``.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import yaml

from cluster.config import ConfigError, TandemConfig, config_from_dict, group_engine_config
from cluster.k8s.alerts import prometheus_rule
from cluster.k8s.disruption import disruption_budgets
from cluster.k8s.kustomize import OVERLAY, kustomize_files
from cluster.k8s.monitoring import pod_monitors
from cluster.k8s.network_policy import network_policy
from cluster.planning.memory_plan import check_memory
from cluster.k8s.plan import plan_worker_groups
from cluster.k8s.pods import API_KEY_FILE, API_KEY_SECRET_KEY
from cluster.k8s.profile_jobs import config_map, profile_job
from cluster.k8s.rayservice import ray_service

MAX_NAME_LEN = 63


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings (serveConfigV2, the ConfigMap's config)."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump_documents(documents: list[dict], header: str) -> str:
    """``documents`` as one multi-document YAML text under a comment ``header``."""
    comment = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    body = "---\n".join(yaml.dump(d, Dumper=_Dumper, sort_keys=False, width=100) for d in documents)
    return comment + body


def read_config(path: str | Path) -> tuple[TandemConfig, dict]:
    """(the full config, the inline config for the replicas: the file without ``kubernetes``)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    config = config_from_dict(data, str(path))
    embedded = {key: value for key, value in data.items() if key != "kubernetes"}
    check_paths_on_volume(config_from_dict(embedded, str(path)), [config.kubernetes.model_volume.mount_path])
    return config, kubernetes_defaults(config, embedded)


def kubernetes_defaults(config: TandemConfig, embedded: dict) -> dict:
    """The inline config as Kubernetes wants it: at least 2 ingress replicas (ConfigError when the
    file asks for fewer), at most one per node (the head holds one), since one ingress on a
    drained node, or two on the same one, would take the whole API down; API keys from the
    mounted Secret, never inline; JSON logs unless the file says."""
    serve = config.serve
    fewest = serve.ingress_autoscaling.min_replicas if serve.ingress_autoscaling else serve.ingress_num_replicas
    if fewest is not None and fewest < 2:
        key = "ingress_autoscaling.min_replicas" if serve.ingress_autoscaling else "ingress_num_replicas"
        raise ConfigError(f"serve.{key} is {fewest}: on Kubernetes the ingress needs at least 2 replicas, so that "
                          "draining one node (an upgrade, a node pool rotation) does not take the API down")
    settings = dict(embedded.get("serve", {}))
    if serve.api_key:
        raise ConfigError("serve.api_key would be copied in clear into the RayService and the profiling ConfigMap: "
                          f"put the keys in the Secret {config.kubernetes.api_key_secret!r} (key "
                          f"{API_KEY_SECRET_KEY!r}) and set serve.api_key_env instead")
    if settings.pop("api_key_env", None) is not None:
        settings["api_key_file"] = API_KEY_FILE  # the Secret, mounted: re-read when it changes
    if fewest is None:
        settings["ingress_num_replicas"] = 2
    settings.setdefault("ingress_max_replicas_per_node", 1)
    settings.setdefault("log_format", "json")  # for the cluster's log collector
    return {**embedded, "serve": settings}


def check_paths_on_volume(config: TandemConfig, mount_paths: list[str]) -> None:
    """ConfigError unless every model, adapter and profile path lies under one of ``mount_paths``."""
    paths = {"model.model": config.model.model, "speculative.draft_model": config.speculative.draft_model,
             "speculative.profile": config.speculative.profile, "model.lora_dir": config.model.lora_dir}
    paths.update({f"model.lora_modules.{name}": folder for name, folder in config.model.lora_modules.items()})
    for group in config.serve.groups:
        model = group_engine_config(config, group.name).model
        paths[f"serve.groups[{group.name}].profile"] = group.profile
        paths.setdefault(f"serve.groups[{group.name}].engine.lora_dir", model.lora_dir)
        paths.update({f"serve.groups[{group.name}].engine.lora_modules.{name}": folder
                      for name, folder in model.lora_modules.items() if name not in config.model.lora_modules})
    roots = [PurePosixPath(m) for m in mount_paths]
    for key, value in paths.items():
        if value is None:
            continue
        path = PurePosixPath(value)
        if not path.is_absolute() or not any(root in path.parents for root in roots):
            raise ConfigError(
                f"{key} is {value!r}: on Kubernetes every model, adapter and profile is read from the weights volume, "
                f"so give an absolute path under {' or '.join(mount_paths) or 'a mounted volume'} "
                "(kubernetes.model_volume.mount_path); nothing is downloaded at start")


def render(config: TandemConfig, embedded: dict, source: str) -> dict[str, str]:
    """File name (relative, POSIX) -> YAML text of every manifest; ``source`` names the config."""
    k8s = config.kubernetes
    plans = plan_worker_groups(config)
    header = (f"Rendered by `tandem k8s render {source}`: edit that file and render again.\n"
              "KubeRay manifests of Tandem; see k8s/README.md.")
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": k8s.namespace}}
    files = {
        "namespace.yaml": dump_documents([namespace], header),
        "rayservice.yaml": dump_documents([ray_service(config, embedded, plans)], header),
    }
    budgets = disruption_budgets(config, plans)
    if budgets:
        files["disruption.yaml"] = dump_documents(budgets, header)
    policy = network_policy(config)
    if policy is not None:
        files["networkpolicy.yaml"] = dump_documents([policy], header)
    monitors = pod_monitors(k8s)
    if monitors:
        files["monitoring.yaml"] = dump_documents(monitors, header)
    rule = prometheus_rule(k8s)
    if rule is not None:
        files["alerts.yaml"] = dump_documents([rule], header)
    jobs = [job for job in (profile_job(config, plan) for plan in plans) if job is not None]
    if jobs:
        files["profile/configmap.yaml"] = dump_documents([config_map(config, embedded)], header)
        for job in jobs:
            group = job["metadata"]["labels"]["tandem/group"]
            files[f"profile/job-{group}.yaml"] = dump_documents([job], header)
    _check_names([yaml.safe_load_all(text) for text in files.values()])
    return files


def _check_names(streams) -> None:
    for stream in streams:
        for document in stream:
            name = document["metadata"]["name"]
            if len(name) > MAX_NAME_LEN:
                raise ConfigError(f"the {document['kind']} name {name!r} is longer than {MAX_NAME_LEN} characters; "
                                  "shorten kubernetes.name or the serve group names")


def write(files: dict[str, str], out_dir: str | Path) -> list[Path]:
    """Write ``files`` under ``out_dir``; returns the YAML files there that were not rendered."""
    out_dir = Path(out_dir)
    for name, text in files.items():
        target = out_dir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    written = {out_dir / name for name in files}
    return sorted(p for p in out_dir.rglob("*.yaml") if p not in written)


def render_to(config_path: str | Path, out_dir: str | Path, source: str | None = None,
              kustomize: bool = False) -> list[Path]:
    """Read, render and write (as a kustomize base and overlay with ``kustomize``; an overlay
    already there is kept); returns the stale YAML files left in ``out_dir``."""
    config, embedded = read_config(config_path)
    check_memory(config)
    files = render(config, embedded, source or str(config_path))
    if kustomize:
        files = kustomize_files(config, files)
        kept = {name for name in files if name.startswith(OVERLAY) and (Path(out_dir) / name).exists()}
        stale = write({name: text for name, text in files.items() if name not in kept}, out_dir)
        return [p for p in stale if p not in {Path(out_dir) / name for name in kept}]
    return write(files, out_dir)
