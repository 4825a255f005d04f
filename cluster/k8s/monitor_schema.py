"""Hand-written JSON schemas of prometheus-operator's PodMonitor, ServiceMonitor and PrometheusRule.

No package on PyPI carries the CustomResourceDefinitions of ``monitoring.coreos.com/v1``
as data (``cloudcoil-models-prometheus-operator`` has pydantic models generated from
them, but they accept unknown keys, so a typo would pass). These schemas follow the
fields of prometheus-operator's API reference for the parts manifests use, and unlike
the CRDs they are closed: a key not listed here is an error, and so is a monitor with
no endpoint (it would scrape nothing). A real field missing here is added here, not
worked around in a manifest.
"""

from __future__ import annotations

_DURATION = {"type": "string", "pattern": r"^(0|([0-9]+(ms|s|m|h|d|w|y))+)$"}
_STRINGS = {"type": "array", "items": {"type": "string"}}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_SECRET_KEY = {"type": "object", "additionalProperties": False, "required": ["key"],
               "properties": {"name": {"type": "string"}, "key": {"type": "string"}, "optional": {"type": "boolean"}}}


def _closed(properties: dict, required: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "additionalProperties": False, "properties": properties, "required": list(required)}


_ACTIONS = ["replace", "keep", "drop", "hashmod", "labelmap", "labeldrop", "labelkeep", "lowercase", "uppercase",
            "keepequal", "dropequal"]
_RELABEL = _closed({
    "sourceLabels": _STRINGS, "separator": {"type": "string"}, "targetLabel": {"type": "string"},
    "regex": {"type": "string"}, "modulus": {"type": "integer", "minimum": 0},
    "replacement": {"type": "string"},
    "action": {"enum": _ACTIONS + ["Replace", "Keep", "Drop", "HashMod", "LabelMap", "LabelDrop", "LabelKeep",
                                   "Lowercase", "Uppercase", "KeepEqual", "DropEqual"]},
})
_LABEL_SELECTOR = _closed({
    "matchLabels": _STRING_MAP,
    "matchExpressions": {"type": "array", "items": _closed({
        "key": {"type": "string"}, "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
        "values": _STRINGS}, required=("key", "operator"))},
})
_NAMESPACE_SELECTOR = _closed({"any": {"type": "boolean"}, "matchNames": _STRINGS})
_PORT = {"anyOf": [{"type": "string", "minLength": 1}, {"type": "integer", "minimum": 1, "maximum": 65535}]}

# Endpoint fields shared by PodMonitor's podMetricsEndpoints and ServiceMonitor's endpoints.
_ENDPOINT = {
    "port": {"type": "string", "minLength": 1}, "targetPort": _PORT, "path": {"type": "string", "pattern": "^/"},
    "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]}, "params": {"type": "object"},
    "interval": _DURATION, "scrapeTimeout": _DURATION, "honorLabels": {"type": "boolean"},
    "honorTimestamps": {"type": "boolean"}, "trackTimestampsStaleness": {"type": "boolean"},
    "enableHttp2": {"type": "boolean"}, "followRedirects": {"type": "boolean"}, "proxyUrl": {"type": "string"},
    "relabelings": {"type": "array", "items": _RELABEL},
    "metricRelabelings": {"type": "array", "items": _RELABEL},
    "bearerTokenSecret": _SECRET_KEY, "authorization": {"type": "object"}, "basicAuth": {"type": "object"},
    "oauth2": {"type": "object"}, "tlsConfig": {"type": "object"},
}
_POD_ENDPOINT = _closed(_ENDPOINT | {"portNumber": {"type": "integer", "minimum": 1, "maximum": 65535},
                                     "filterRunning": {"type": "boolean"}})
_SERVICE_ENDPOINT = _closed(_ENDPOINT | {"bearerTokenFile": {"type": "string"}})

# Spec fields shared by both kinds.
_SPEC = {
    "selector": _LABEL_SELECTOR, "namespaceSelector": _NAMESPACE_SELECTOR, "jobLabel": {"type": "string"},
    "podTargetLabels": _STRINGS, "sampleLimit": {"type": "integer", "minimum": 0},
    "targetLimit": {"type": "integer", "minimum": 0}, "labelLimit": {"type": "integer", "minimum": 0},
    "scrapeClass": {"type": "string", "minLength": 1}, "attachMetadata": _closed({"node": {"type": "boolean"}}),
}
_METADATA = _closed({"name": {"type": "string", "minLength": 1}, "namespace": {"type": "string"},
                     "labels": _STRING_MAP, "annotations": _STRING_MAP}, required=("name",))


def _resource(kind: str, spec: dict) -> dict:
    return _closed({"apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": kind},
                    "metadata": _METADATA, "spec": spec}, required=("apiVersion", "kind", "metadata", "spec"))


POD_MONITOR = _resource("PodMonitor", _closed(
    _SPEC | {"podMetricsEndpoints": {"type": "array", "items": _POD_ENDPOINT, "minItems": 1}},
    required=("selector", "podMetricsEndpoints")))
SERVICE_MONITOR = _resource("ServiceMonitor", _closed(
    _SPEC | {"endpoints": {"type": "array", "items": _SERVICE_ENDPOINT, "minItems": 1},
             "targetLabels": _STRINGS},
    required=("selector", "endpoints")))

_RULE = _closed({"alert": {"type": "string", "minLength": 1}, "record": {"type": "string", "minLength": 1},
                 "expr": {"type": "string", "minLength": 1}, "for": _DURATION, "keep_firing_for": _DURATION,
                 "labels": _STRING_MAP, "annotations": _STRING_MAP}, required=("expr",))
PROMETHEUS_RULE = _resource("PrometheusRule", _closed({"groups": {"type": "array", "minItems": 1, "items": _closed(
    {"name": {"type": "string", "minLength": 1}, "interval": _DURATION, "limit": {"type": "integer", "minimum": 0},
     "partial_response_strategy": {"type": "string"},
     "rules": {"type": "array", "minItems": 1, "items": _RULE}}, required=("name", "rules"))}},
    required=("groups",)))

SCHEMAS = {("monitoring.coreos.com/v1", "PodMonitor"): POD_MONITOR,
           ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR,
           ("monitoring.coreos.com/v1", "PrometheusRule"): PROMETHEUS_RULE}
