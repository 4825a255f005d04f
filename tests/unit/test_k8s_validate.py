"""The manifest validator rejects what the API server (or Tandem) would reject.

Each test breaks one thing in a manifest rendered from configs/gpu-single.yaml and checks
the error names it: the checks of test_k8s_manifests.py can fail.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from cluster.k8s.render import read_config, render
from cluster.k8s.validate import ManifestError, ManifestValidator, closed

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def validator() -> ManifestValidator:
    return ManifestValidator.from_repo()


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    config, embedded = read_config(ROOT / "configs" / "gpu-single.yaml")
    return {name: list(yaml.safe_load_all(text)) for name, text in render(config, embedded, "test").items()}


def _service(rendered) -> dict:
    return copy.deepcopy(rendered["rayservice.yaml"][0])


def _rejects(validator, document, *fragments: str) -> None:
    with pytest.raises(ManifestError) as info:
        validator.validate_document(document, "test.yaml")
    for fragment in fragments:
        assert fragment in str(info.value)


def test_the_untouched_manifests_pass(validator, rendered):
    for documents in rendered.values():
        for document in documents:
            validator.validate_document(document)


def test_a_typo_in_a_container_field_of_the_rayservice_is_rejected(validator, rendered):
    service = _service(rendered)
    container = service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    container["volumeMount"] = container.pop("volumeMounts")
    _rejects(validator, service, "RayService tandem", "containers.0", "'volumeMount' was unexpected")


def test_a_bad_head_group_spec_is_rejected(validator, rendered):
    service = _service(rendered)
    del service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    _rejects(validator, service, "headGroupSpec", "'template' is a required property")
    service = _service(rendered)
    service["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-gpus"] = 0
    _rejects(validator, service, "rayStartParams.num-gpus", "not of type 'string'")
    service = _service(rendered)
    service["spec"]["rayClusterConfig"]["headGroupSpec"]["serviceTipe"] = "ClusterIP"
    _rejects(validator, service, "'serviceTipe' was unexpected")


def test_a_bad_quantity_in_a_pod_template_is_rejected(validator, rendered):
    service = _service(rendered)
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head["resources"]["limits"]["memory"] = "16 gigabytes"
    _rejects(validator, service, "resources.limits.memory")


def test_a_serve_config_that_tandem_refuses_is_rejected(validator, rendered):
    service = _service(rendered)
    text = service["spec"]["serveConfigV2"]
    service["spec"]["serveConfigV2"] = text.replace("max_num_seqs: 32", "max_num_seqs: 0")
    _rejects(validator, service, "serveConfigV2", "scheduler.max_num_seqs")
    service["spec"]["serveConfigV2"] = text.replace("draft_model: /models/", "draft_model: /home/me/")
    _rejects(validator, service, "speculative.draft_model", "/models")
    service["spec"]["serveConfigV2"] = text.replace("deployments.app:app_builder", "deployments.app:build_app")
    _rejects(validator, service, "import_path must be deployments.app:app_builder")
    serve = yaml.safe_load(text)
    serve["applications"][0]["args"]["config"]["kubernetes"] = {"namespace": "x"}
    service["spec"]["serveConfigV2"] = yaml.safe_dump(serve)
    _rejects(validator, service, "must not carry the kubernetes section")
    del service["spec"]["serveConfigV2"]
    _rejects(validator, service, "serveConfigV2: required")


def test_a_typo_in_a_core_object_is_rejected(validator, rendered):
    job = copy.deepcopy(rendered["profile/job-l4.yaml"][0])
    job["spec"]["template"]["spec"]["activeDeadlineSeconds"] = "one hour"
    _rejects(validator, job, "Job tandem-profile-l4", "spec.template.spec.activeDeadlineSeconds")
    job = copy.deepcopy(rendered["profile/job-l4.yaml"][0])
    job["spec"]["backofLimit"] = job["spec"].pop("backoffLimit")
    _rejects(validator, job, "'backofLimit' was unexpected")


def test_monitors_are_checked_against_prometheus_operators_crds(validator, rendered):
    monitor = copy.deepcopy(rendered["monitoring.yaml"][1])
    monitor["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    _rejects(validator, monitor, "PodMonitor tandem-ray-workers", "'intervall' was unexpected")
    monitor = copy.deepcopy(rendered["monitoring.yaml"][1])
    del monitor["spec"]["selector"]
    _rejects(validator, monitor, "'selector' is a required property")
    monitor = copy.deepcopy(rendered["monitoring.yaml"][1])
    monitor["spec"]["podMetricsEndpoints"][0]["interval"] = "fifteen seconds"
    _rejects(validator, monitor, "interval")
    monitor = copy.deepcopy(rendered["monitoring.yaml"][1])
    monitor["spec"]["podMetricsEndpoints"] = []
    _rejects(validator, monitor, "spec.podMetricsEndpoints is empty")


def test_alert_rules_are_checked_against_prometheus_operators_crd(validator, rendered):
    rules = next(d for docs in rendered.values() for d in docs if d["kind"] == "PrometheusRule")
    rules = copy.deepcopy(rules)
    rules["spec"]["groups"][0]["rules"][0]["annotation"] = {"summary": "a typo of annotations"}
    _rejects(validator, rules, "PrometheusRule", "'annotation' was unexpected")
    del rules["spec"]["groups"][0]["rules"][0]["annotation"]
    rules["spec"]["groups"][0]["rules"][0]["for"] = "five minutes"
    _rejects(validator, rules, "PrometheusRule", "for")


def test_unknown_kinds_and_bad_names_are_errors(validator):
    _rejects(validator, {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}},
             "no schema knows this kind")
    _rejects(validator, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "Tandem_NS"}},
             "metadata.name")
    _rejects(validator, ["not", "a", "mapping"], "a manifest is a mapping")


def test_files_are_validated_document_by_document(validator, tmp_path, rendered):
    good = yaml.safe_dump_all(rendered["monitoring.yaml"])
    (tmp_path / "ok.yaml").write_text(good)
    assert validator.validate_paths([tmp_path]) == 2
    broken = copy.deepcopy(rendered["monitoring.yaml"])
    broken[1]["spec"]["podMetricsEndpoints"][0]["port"] = 8080
    (tmp_path / "ok.yaml").write_text(yaml.safe_dump_all(broken))
    with pytest.raises(ManifestError, match=r"ok\.yaml \(document 2\)"):
        validator.validate_paths([tmp_path])


def test_closing_a_crd_schema_keeps_maps_and_preserved_fields_open():
    schema = {"type": "object", "properties": {
        "spec": {"type": "object", "properties": {"a": {"type": "string"}}},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {"b": {}}},
        "list": {"type": "array", "items": {"type": "object", "properties": {"c": {}}}},
    }}
    result = closed(schema)
    assert result["additionalProperties"] is False
    assert result["properties"]["spec"]["additionalProperties"] is False
    assert result["properties"]["labels"]["additionalProperties"] == {"type": "string"}
    assert "additionalProperties" not in result["properties"]["free"]
    assert result["properties"]["list"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the input is left alone
