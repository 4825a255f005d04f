"""The ``kubernetes`` section of a Tandem config: what only a KubeRay deployment needs.

The rest of the config (model, speculative, serve groups, ...) says *what* runs; this
section says *where*: the image, the namespace, the volume holding the weights, and for
each serve group the shape of its worker pods (GPUs per node, CPU, memory, shared
memory, node selector, tolerations). ``tandem k8s render CONFIG`` turns both into
manifests; the serve application never reads this section.

Defaults that depend on the serve group (pod CPUs, GPU node selector, GPU toleration)
are ``None`` here and derived in :mod:`cluster.k8s.plan`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# A Kubernetes resource quantity as written in manifests: "4", "500m", "16Gi".
QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"
# A DNS-1123 label, kept short enough for the names KubeRay derives from it.
DNS_LABEL = r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Toleration(_Strict):
    """A pod toleration (Kubernetes' fields, snake_case)."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Exists"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(None, ge=0, description="only with effect NoExecute")


class ModelVolume(_Strict):
    """The volume with the weights (and the profiles); mounted read-only by the Ray pods."""

    claim_name: str = Field("tandem-models", pattern=r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$",
                            description="an existing PersistentVolumeClaim, readable from every node")
    mount_path: str = Field("/models", pattern=r"^/.+", description="model paths in the config must lie under it")
    cache_subdir: str = Field(".tandem-cache", pattern=r"^[^/].*",
                              description="TANDEM_CACHE_DIR, relative to mount_path (converted GGUF files)")


class HeadPod(_Strict):
    """The Ray head: GCS, dashboard, Serve controller and HTTP proxy, and one ingress replica (no engine)."""

    cpu: str = Field("4", pattern=QUANTITY)
    memory: str = Field("16Gi", pattern=QUANTITY)
    shm_size: str = Field("2Gi", pattern=QUANTITY, description="/dev/shm (memory-backed) for Ray's object store")
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)


class WorkerPods(_Strict):
    """The worker pods of one serve group (one KubeRay worker group per GPU kind)."""

    gpus_per_node: int | None = Field(
        None, ge=1, description="nvidia.com/gpu of one worker pod (one pod per node); default: one replica's GPUs")
    cpu: str | None = Field(None, pattern=QUANTITY,
                            description="default: the CPUs of the replicas that fit in the pod, plus 2")
    memory: str = Field("32Gi", pattern=QUANTITY, description="host memory of one worker pod")
    shm_size: str = Field("8Gi", pattern=QUANTITY, description="/dev/shm (memory-backed) for NCCL and Ray")
    node_selector: dict[str, str] | None = Field(
        None, description="default for GPU groups: {nvidia.com/gpu.product: NVIDIA-<accelerator_type>}")
    tolerations: list[Toleration] | None = Field(
        None, description="default for GPU groups: tolerate the nvidia.com/gpu taint")
    idle_timeout_s: int | None = Field(None, ge=0, description="autoscaler idle time before removing a pod")


class Upgrades(_Strict):
    """How KubeRay rolls out a change to the Ray pods (RayService ``upgradeStrategy``).

    ``NewCluster`` (KubeRay's default) brings up a whole second Ray cluster and moves traffic
    when it serves: twice the GPUs for a while. ``NewClusterWithIncrementalUpgrade`` grows the
    new cluster in steps of ``max_surge_percent`` of capacity and shifts ``step_size_percent``
    of the traffic every ``interval_seconds`` through a Gateway API gateway (``gateway_class_name``;
    KubeRay's feature gate RayServiceIncrementalUpgrade on). ``None`` changes nothing until
    you delete the RayService yourself."""

    strategy: Literal["NewCluster", "NewClusterWithIncrementalUpgrade", "None"] = "NewCluster"
    gateway_class_name: str | None = Field(None, description="a GatewayClass of your cluster (incremental only)")
    interval_seconds: int = Field(60, ge=1)
    step_size_percent: int = Field(10, ge=1, le=100)
    max_surge_percent: int = Field(25, ge=1, le=100)

    @model_validator(mode="after")
    def _check(self) -> "Upgrades":
        if self.strategy == "NewClusterWithIncrementalUpgrade" and not self.gateway_class_name:
            raise ValueError("kubernetes.upgrades.gateway_class_name is required by NewClusterWithIncrementalUpgrade "
                             "(traffic moves through a Gateway API gateway of that class)")
        return self


class HeadFaultTolerance(_Strict):
    """GCS fault tolerance: the head keeps the cluster's state in an external Redis, so a head
    restart neither loses the Serve application nor restarts the worker pods."""

    redis_address: str = Field(..., min_length=1, description="host:port of a Redis reachable from the head")
    password_secret: str | None = Field(None, description="Secret holding the Redis password under key 'password'")


class NetworkPolicySettings(_Strict):
    """A NetworkPolicy on the Ray pods: Ray's ports (GCS, dashboard, job API, workers) answer only the
    cluster's own pods, the KubeRay operator and Prometheus; the API port answers everyone."""

    enabled: bool = True
    operator_pods: dict[str, str] = Field(
        default_factory=lambda: {"app.kubernetes.io/name": "kuberay-operator"},
        description="labels of the KubeRay operator's pods (any namespace): they reach the dashboard and GCS")
    prometheus_pods: dict[str, str] = Field(
        default_factory=lambda: {"app.kubernetes.io/name": "prometheus"},
        description="labels of Prometheus' pods (any namespace): they reach the metrics ports")


class Monitoring(_Strict):
    """PodMonitors (prometheus-operator) that scrape Ray's metrics port on every Ray pod."""

    enabled: bool = True
    labels: dict[str, str] = Field(
        default_factory=lambda: {"release": "prometheus"},
        description="labels your Prometheus selects PodMonitors by (kube-prometheus-stack: its release name)")
    interval: str = Field("15s", pattern=r"^[0-9]+(ms|s|m|h)$")
    alerts: bool = Field(True, description="render a PrometheusRule with Tandem's alerts (alerts.yaml)")
    ttft_p99_seconds: float = Field(5.0, gt=0, description="alert when a group's TTFT p99 stays above this")
    error_ratio: float = Field(0.05, gt=0, lt=1, description="alert when this share of HTTP responses are 5xx")


class KubernetesConfig(_Strict):
    name: str = Field("tandem", pattern=DNS_LABEL, description="the RayService; prefix of the other objects")
    namespace: str = Field("tandem", pattern=DNS_LABEL)
    image: str = Field("tandem:0.1.0", min_length=1, description="built from k8s/Dockerfile, pushed to your registry")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    ray_version: str = Field("2.60.0", pattern=r"^[0-9]+\.[0-9]+\.[0-9]+$", description="must match the image")
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(
        "ClusterIP", description="the Service in front of Serve's HTTP port")
    api_key_secret: str = Field(
        "tandem-api-key", pattern=r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$",
        description="Secret whose key 'api-key' fills serve.api_key_env (only when that is set)")
    logs_sidecar: bool = Field(
        True, description="with serve.log_format json: a container 'ray-logs' in every Ray pod prints the JSON lines "
        "of Ray's log files (Serve's records and access lines, the engine cores') to its standard output, for "
        "kubectl logs and node log agents; Ray's /tmp/ray becomes an emptyDir the two containers share")
    autoscaler_idle_timeout_s: int = Field(
        600, ge=0, description="Ray autoscaler: idle seconds before a pod goes (as long as Serve's downscale delay: "
        "a GPU pod takes minutes to come back)")
    upgrades: Upgrades = Field(default_factory=Upgrades)
    head_fault_tolerance: HeadFaultTolerance | None = Field(
        None, description="GCS fault tolerance with an external Redis (off by default)")
    pod_disruption_budget: bool = Field(
        True, description="a PodDisruptionBudget per worker group: voluntary evictions take one pod at a time")
    model_volume: ModelVolume = Field(default_factory=ModelVolume)
    head: HeadPod = Field(default_factory=HeadPod)
    groups: dict[str, WorkerPods] = Field(
        default_factory=dict, description="worker pods per serve group name; a group left out gets the defaults")
    monitoring: Monitoring = Field(default_factory=Monitoring)
    network_policy: NetworkPolicySettings = Field(default_factory=NetworkPolicySettings)
    ray_auth: Literal["token", "disabled"] = Field(
        "token", description="KubeRay authOptions: token makes Ray's dashboard and job API ask for the cluster's "
        "token (KubeRay 1.5+ makes it and hands it to the pods and the operator)")
