"""Tandem's PrometheusRule: valid for promtool, and each alert fires on made-up series that
should fire it and stays quiet on series that should not (``promtool test rules``)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from cluster.k8s.alerts import prometheus_rule, rule_groups
from cluster.config_k8s import KubernetesConfig
from cluster.k8s.render import read_config, render

ROOT = Path(__file__).resolve().parents[2]
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (make install adds Debian's "
                                                             "prometheus package where apt is available)")
K8S = KubernetesConfig(name="tandem", namespace="tandem")
APP = 'application="tandem"'


def _write_rules(tmp_path: Path) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule_groups(K8S)}, sort_keys=False))
    return path


@needs_promtool
def test_promtool_accepts_the_rules(tmp_path):
    result = subprocess.run([PROMTOOL, "check", "rules", str(_write_rules(tmp_path))], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 6 rules found" in result.stdout


def _case(series: list[tuple[str, str]], eval_time: str, alert: str, fired: list[dict]) -> dict:
    return {"interval": "1m", "input_series": [{"series": s, "values": v} for s, v in series],
            "alert_rule_test": [{"eval_time": eval_time, "alertname": alert, "exp_alerts": fired}]}


def _fired(labels: dict, summary: str) -> dict:
    return {"exp_labels": labels, "exp_annotations": {"summary": summary}}


@needs_promtool
def test_each_alert_fires_on_its_condition_and_only_then(tmp_path):
    replica = f'{APP}, group="a10g", replica="r1", deployment="replica-a10g", device_kind="A10G"'
    cases = [
        # the queue grows for 30 minutes / stays flat at 5
        _case([(f"vllm:num_requests_waiting{{{replica}}}", "0+1x40")], "30m", "TandemQueueGrowing",
              [_fired({"severity": "warning", "application": "tandem", "group": "a10g"},
                      "Requests keep queueing in group a10g: add replicas or raise autoscaling's bounds")]),
        _case([(f"vllm:num_requests_waiting{{{replica}}}", "5x40")], "30m", "TandemQueueGrowing", []),
        _case([(f"vllm:kv_cache_usage_perc{{{replica}}}", "0.97x20")], "10m", "TandemKVCacheFull",
              [_fired({"severity": "warning", "application": "tandem", "group": "a10g", "replica": "r1"},
                      "KV cache of r1 above 95%: requests will be preempted and queue")]),
        _case([(f"vllm:kv_cache_usage_perc{{{replica}}}", "0.90x20")], "10m", "TandemKVCacheFull", []),
        # 10 of 100 responses per minute are 500s / 1 of 100
        _case([(f'ray_serve_num_http_requests_total{{{APP}, route="/v1/completions", method="POST", '
                f'status_code="200"}}', "0+100x20"),
               (f'ray_serve_num_http_error_requests_total{{{APP}, route="/v1/completions", method="POST", '
                f'error_code="500"}}', "0+10x20")], "15m", "TandemHighErrorRatio",
              [_fired({"severity": "critical", "application": "tandem"}, "More than 5% of responses are server errors")]),
        _case([(f'ray_serve_num_http_requests_total{{{APP}, route="/v1/completions", method="POST", '
                f'status_code="200"}}', "0+100x20"),
               (f'ray_serve_num_http_error_requests_total{{{APP}, route="/v1/completions", method="POST", '
                f'error_code="500"}}', "0+1x20")], "15m", "TandemHighErrorRatio", []),
        # every first token in the 10 s bucket / in the 1 s bucket
        _case([(f'vllm:time_to_first_token_seconds_bucket{{{replica}, le="1"}}', "0x30"),
               (f'vllm:time_to_first_token_seconds_bucket{{{replica}, le="10"}}', "0+10x30"),
               (f'vllm:time_to_first_token_seconds_bucket{{{replica}, le="+Inf"}}', "0+10x30")],
              "20m", "TandemSlowFirstToken",
              [_fired({"severity": "warning", "application": "tandem", "group": "a10g"},
                      "TTFT p99 of group a10g above 5.0 s")]),
        _case([(f'vllm:time_to_first_token_seconds_bucket{{{replica}, le="1"}}', "0+10x30"),
               (f'vllm:time_to_first_token_seconds_bucket{{{replica}, le="10"}}', "0+10x30"),
               (f'vllm:time_to_first_token_seconds_bucket{{{replica}, le="+Inf"}}', "0+10x30")],
              "20m", "TandemSlowFirstToken", []),
        _case([(f'ray_serve_deployment_replica_healthy{{{APP}, deployment="replica-a10g", replica="r1"}}', "0x10")],
              "8m", "TandemReplicaUnhealthy",
              [_fired({"severity": "critical", "application": "tandem", "deployment": "replica-a10g",
                       "replica": "r1"}, "Serve replica r1 of replica-a10g is unhealthy")]),
        _case([(f'ray_serve_deployment_replica_healthy{{{APP}, deployment="replica-a10g", replica="r1"}}', "1x10")],
              "8m", "TandemReplicaUnhealthy", []),
        _case([('kube_pod_container_status_restarts_total{namespace="tandem", pod="tandem-raycluster-a10g-x", '
                'container="ray-worker"}', "0 0 1 2 3 4 4 4")], "6m", "TandemPodRestarts",
              [_fired({"severity": "warning", "namespace": "tandem", "pod": "tandem-raycluster-a10g-x",
                       "container": "ray-worker"},
                      "Container ray-worker of pod tandem-raycluster-a10g-x restarted more than twice in 30 minutes")]),
        _case([('kube_pod_container_status_restarts_total{namespace="other", pod="tandem-raycluster-a10g-x", '
                'container="ray-worker"}', "0 0 1 2 3 4 4 4")], "6m", "TandemPodRestarts", []),
    ]
    rules = _write_rules(tmp_path)
    tests = tmp_path / "tests.yaml"
    tests.write_text(yaml.safe_dump({"rule_files": [rules.name], "evaluation_interval": "1m", "tests": cases},
                                    sort_keys=False))
    result = subprocess.run([PROMTOOL, "test", "rules", str(tests)], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_rendered_rule_carries_the_monitoring_labels_and_validates():
    from cluster.k8s.validate import ManifestValidator

    config, embedded = read_config(ROOT / "configs" / "gpu-single.yaml")
    rule = yaml.safe_load(render(config, embedded, "x")["alerts.yaml"])
    assert rule["kind"] == "PrometheusRule" and rule["metadata"]["labels"]["release"] == "prometheus"
    assert [r["alert"] for r in rule["spec"]["groups"][0]["rules"]] == [
        "TandemQueueGrowing", "TandemKVCacheFull", "TandemHighErrorRatio", "TandemSlowFirstToken",
        "TandemReplicaUnhealthy", "TandemPodRestarts"]
    ManifestValidator.from_repo().validate_document(rule)
    quiet = K8S.model_copy(update={"monitoring": K8S.monitoring.model_copy(update={"alerts": False})})
    assert prometheus_rule(quiet) is None
