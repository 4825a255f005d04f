"""Pod templates of the Ray head and of one worker group, as plain dicts.

Every Ray pod runs the Tandem image, mounts the weights volume read-only at
``model_volume.mount_path`` (the ingress reads the tokenizer, replicas the weights), gets
a memory-backed ``/dev/shm``, exposes Ray's metrics port, and is probed over HTTP:

- liveness, head and workers: the raylet's health on the dashboard agent's port;
- readiness, head: the GCS health on the dashboard's port;
- readiness, workers: Serve's proxy ``/-/healthz``, so the serve Service only sends
  requests to pods whose proxy is up (a pod with no replica has no proxy and stays
  unready, which KubeRay expects).

Nothing is downloaded at start: the Hugging Face libraries run offline and
``TANDEM_CACHE_DIR`` lies on the read-only volume.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.config_k8s import KubernetesConfig
from cluster.k8s.plan import WorkerGroupPlan, toleration_dict

API_KEY_SECRET_KEY = "api-key"
API_KEYS_DIR = "/etc/tandem/api-keys"  # the Secret, mounted: the kubelet updates it in place on rotation
API_KEY_FILE = f"{API_KEYS_DIR}/{API_KEY_SECRET_KEY}"


@dataclass(frozen=True)
class RayPorts:
    """Ports of a Ray node: Ray's defaults, plus Serve's and the metrics port from the config."""

    serve: int
    metrics: int
    gcs: int = 6379
    dashboard: int = 8265
    client: int = 10001
    dashboard_agent: int = 52365
    autoscaler_metrics: int = 44217
    dashboard_metrics: int = 44227


def labels(k8s: KubernetesConfig, component: str) -> dict[str, str]:
    """The labels every object of this deployment carries (PodMonitors select pods by them)."""
    return {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": k8s.name,
            "app.kubernetes.io/component": component}


def environment(k8s: KubernetesConfig) -> list[dict]:
    """Environment of every Tandem container: cache on the volume, no hub access."""
    return [
        {"name": "TANDEM_CACHE_DIR", "value": f"{k8s.model_volume.mount_path.rstrip('/')}/"
                                              f"{k8s.model_volume.cache_subdir}"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "TRANSFORMERS_OFFLINE", "value": "1"},
    ]


def api_key_volume(k8s: KubernetesConfig) -> tuple[dict, dict]:
    """(volume, mount) of the API keys' Secret, as the file ``serve.api_key_file`` names: the ingress
    reads it again when the kubelet updates it, so keys rotate without a restart."""
    volume = {"name": "api-keys", "secret": {"secretName": k8s.api_key_secret,
                                             "items": [{"key": API_KEY_SECRET_KEY, "path": API_KEY_SECRET_KEY}]}}
    return volume, {"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True}


def model_volume(k8s: KubernetesConfig, read_only: bool = True) -> tuple[dict, dict]:
    """(volume, mount) of the weights claim."""
    volume = {"name": "models", "persistentVolumeClaim": {"claimName": k8s.model_volume.claim_name,
                                                          "readOnly": read_only}}
    mount = {"name": "models", "mountPath": k8s.model_volume.mount_path, "readOnly": read_only}
    return volume, mount


def shm_volume(size: str) -> tuple[dict, dict]:
    """(volume, mount) of a memory-backed /dev/shm of ``size``."""
    return ({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": size}},
            {"name": "dshm", "mountPath": "/dev/shm"})


RAY_TEMP_DIR = "/tmp/ray"  # Ray's default temp folder; its logs are under session_latest/logs


def add_logs_sidecar(k8s: KubernetesConfig, spec: dict) -> None:
    """Add to a Ray pod's ``spec`` the ``ray-logs`` container, which prints the JSON lines of Ray's log
    files to its standard output (``cluster/shared/log_follow.py``), and the emptyDir both containers
    mount as Ray's temp folder. Requests equal limits, as the Ray container's (QoS unchanged)."""
    spec["volumes"].append({"name": "ray-tmp", "emptyDir": {}})
    spec["containers"][0]["volumeMounts"].append({"name": "ray-tmp", "mountPath": RAY_TEMP_DIR})
    size = {"cpu": "100m", "memory": "64Mi"}
    spec["containers"].append({
        "name": "ray-logs",
        "image": k8s.image,
        "imagePullPolicy": k8s.image_pull_policy,
        "command": ["python", "-m", "cluster.shared.log_follow", "--dir", f"{RAY_TEMP_DIR}/session_latest/logs"],
        "resources": {"requests": dict(size), "limits": dict(size)},
        "volumeMounts": [{"name": "ray-tmp", "mountPath": RAY_TEMP_DIR, "readOnly": True}],
    })


def _http_probe(port: int, path: str, failure_threshold: int) -> dict:
    return {"httpGet": {"path": path, "port": port}, "initialDelaySeconds": 10, "periodSeconds": 5,
            "timeoutSeconds": 2, "failureThreshold": failure_threshold}


def _port(name: str, number: int) -> dict:
    return {"name": name, "containerPort": number, "protocol": "TCP"}


def head_template(k8s: KubernetesConfig, ports: RayPorts, api_keys: bool, grace_s: int) -> dict:
    """The head pod: no GPU, no replica; the Serve controller, a proxy and the dashboard. ``grace_s``:
    its terminationGracePeriodSeconds (the serve config's drain time and a margin); ``api_keys``:
    mount the API keys' Secret."""
    models, models_mount = model_volume(k8s)
    shm, shm_mount = shm_volume(k8s.head.shm_size)
    size = {"cpu": k8s.head.cpu, "memory": k8s.head.memory}
    container = {
        "name": "ray-head",
        "image": k8s.image,
        "imagePullPolicy": k8s.image_pull_policy,
        "ports": [_port("gcs-server", ports.gcs), _port("dashboard", ports.dashboard),
                  _port("client", ports.client), _port("serve", ports.serve), _port("metrics", ports.metrics),
                  _port("as-metrics", ports.autoscaler_metrics), _port("dash-metrics", ports.dashboard_metrics)],
        "env": environment(k8s),
        "resources": {"requests": dict(size), "limits": dict(size)},
        "volumeMounts": [models_mount, shm_mount],
        "livenessProbe": _http_probe(ports.dashboard_agent, "/api/local_raylet_healthz", 40),
        "readinessProbe": _http_probe(ports.dashboard, "/api/gcs_healthz", 20),
    }
    spec: dict = {"containers": [container], "volumes": [models, shm], "terminationGracePeriodSeconds": grace_s}
    _mount_api_keys(k8s, spec, api_keys)
    if k8s.head.node_selector:
        spec["nodeSelector"] = dict(k8s.head.node_selector)
    if k8s.head.tolerations:
        spec["tolerations"] = [toleration_dict(t) for t in k8s.head.tolerations]
    return {"metadata": {"labels": labels(k8s, "ray-head")}, "spec": spec}


def worker_template(k8s: KubernetesConfig, plan: WorkerGroupPlan, ports: RayPorts,
                    api_keys: bool, grace_s: int) -> dict:
    """A worker pod of one group: the node's GPUs, its replicas, a Serve proxy; ``grace_s`` as the head's."""
    models, models_mount = model_volume(k8s)
    shm, shm_mount = shm_volume(plan.pods.shm_size)
    requests = {"cpu": str(plan.cpus_per_pod), "memory": plan.pods.memory}
    limits = dict(requests)
    if plan.gpus_per_pod:
        limits["nvidia.com/gpu"] = str(plan.gpus_per_pod)
    container = {
        "name": "ray-worker",
        "image": k8s.image,
        "imagePullPolicy": k8s.image_pull_policy,
        "ports": [_port("serve", ports.serve), _port("metrics", ports.metrics)],
        "env": environment(k8s),
        "resources": {"requests": requests, "limits": limits},
        "volumeMounts": [models_mount, shm_mount],
        "livenessProbe": _http_probe(ports.dashboard_agent, "/api/local_raylet_healthz", 40),
        "readinessProbe": _http_probe(ports.serve, "/-/healthz", 3),
    }
    spec: dict = {"containers": [container], "volumes": [models, shm], "terminationGracePeriodSeconds": grace_s}
    _mount_api_keys(k8s, spec, api_keys)
    if plan.node_selector:
        spec["nodeSelector"] = dict(plan.node_selector)
    if plan.tolerations:
        spec["tolerations"] = [dict(t) for t in plan.tolerations]
    template_labels = labels(k8s, "ray-worker") | {"tandem/group": plan.name}
    return {"metadata": {"labels": template_labels}, "spec": spec}


def _mount_api_keys(k8s: KubernetesConfig, spec: dict, api_keys: bool) -> None:
    if api_keys:
        volume, mount = api_key_volume(k8s)
        spec["volumes"].append(volume)
        spec["containers"][0]["volumeMounts"].append(mount)
