"""How the ingress is scaled: one replica by default, the config's count or autoscaling, and
direct ingress (one port) refusing several (no Ray started)."""

from __future__ import annotations

import pytest

from cluster.config import ConfigError, config_from_dict
from deployments.app import ingress_scaling
from deployments.local import direct_ingress_environment


def _config(**serve) -> object:
    return config_from_dict({"serve": {"port": 8123, **serve}})


def test_the_ingress_has_one_replica_unless_the_config_says_otherwise():
    assert ingress_scaling(_config()) == {"num_replicas": 1}
    assert ingress_scaling(_config(ingress_num_replicas=3)) == {"num_replicas": 3}
    scaling = ingress_scaling(_config(ingress_autoscaling={"min_replicas": 2, "max_replicas": 5,
                                                           "target_ongoing_requests": 256}))["autoscaling_config"]
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == (2, 5, 256)


def test_direct_ingress_serves_one_port_from_one_replica():
    assert direct_ingress_environment(_config())["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] == "8123"
    with pytest.raises(ConfigError, match="set serve.direct_ingress: false"):
        direct_ingress_environment(_config(ingress_num_replicas=2))
    assert direct_ingress_environment(_config(ingress_num_replicas=2, direct_ingress=False)) == {}
