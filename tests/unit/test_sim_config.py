"""Simulation configs: errors name the key; the shipped configs load."""

from pathlib import Path

import pytest
from test_sim_helpers import sim_config

from cluster.config import ConfigError
from cluster.sim.config import load_sim_config, parse_controller
from cluster.sim.runner import cells

SIM_CONFIGS = sorted(p for p in (Path(__file__).resolve().parents[2] / "configs" / "sim").glob("*.yaml")
                     if p.name != "devices.yaml" and not p.name.endswith("-engine.yaml"))  # not simulations
GROUP = {"name": "a", "device": "H100"}


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match="unknown key 'groups.0.max_num_seq'"):
        sim_config([{**GROUP, "max_num_seq": 4}])


def test_wrong_type_is_named():
    with pytest.raises(ConfigError, match="'workload.output_len'"):
        sim_config([GROUP], workload={"rate": 1.0, "output_len": "long"})


def test_bad_controller_and_router_are_named():
    with pytest.raises(ConfigError, match="'controllers'.*fixed:K"):
        sim_config([GROUP], controllers=["fixed:x"])
    with pytest.raises(ConfigError, match="'routers.0'"):
        sim_config([GROUP], routers=["random"])


def test_workload_needs_one_of_rate_and_load():
    with pytest.raises(ConfigError, match="workload.*exactly one of rate and load"):
        sim_config([GROUP], workload={"rate": 1.0, "load": 0.5})


def test_derived_group_needs_model_figures():
    with pytest.raises(ConfigError, match=r"\['a'\].*derived"):
        sim_config([GROUP], target=None)


def test_controller_names():
    assert parse_controller("fixed:3") == ("fixed", 3)
    assert parse_controller("adaptive") == ("adaptive", None)
    with pytest.raises(ValueError):
        parse_controller("table:2")


def test_cells_compare_routers_and_controllers_against_the_baselines():
    config = sim_config([GROUP], routers=["tandem", "pow2"], controllers=["adaptive", "fixed:2"])
    assert cells(config) == [("tandem", "adaptive"), ("pow2", "adaptive"), ("tandem", "fixed:2")]


@pytest.mark.parametrize("path", SIM_CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    config = load_sim_config(path)
    assert config.groups and all(Path(g.profile).is_file() for g in config.groups if g.profile)
