"""What ``GET /health`` reads from Serve's status: which replica groups cannot serve yet."""

from ray.serve._private.common import DeploymentStatus, DeploymentStatusTrigger, ReplicaState
from ray.serve.schema import ApplicationStatus, ApplicationStatusOverview, DeploymentStatusOverview, ServeStatus

from cluster.config_serve import replica_deployment_name
from deployments.readiness import GroupWatch, unready_groups


def _deployment(states: dict, status=DeploymentStatus.HEALTHY, message: str = "") -> DeploymentStatusOverview:
    return DeploymentStatusOverview(status=status, status_trigger=DeploymentStatusTrigger.UNSPECIFIED,
                                    replica_states=states, message=message)


def _status(deployments: dict, app: str = "tandem") -> ServeStatus:
    overview = ApplicationStatusOverview(status=ApplicationStatus.RUNNING, message="", last_deployed_time_s=0.0,
                                         deployments=deployments)
    return ServeStatus(applications={app: overview})


def test_every_group_with_a_running_replica_is_ready():
    status = _status({"ingress": _deployment({ReplicaState.RUNNING: 1}),
                      replica_deployment_name("fast"): _deployment({ReplicaState.RUNNING: 2}),
                      replica_deployment_name("slow"): _deployment({ReplicaState.RUNNING: 1,
                                                                    ReplicaState.STARTING: 1})})
    assert unready_groups(status, "tandem", ["fast", "slow"]) == {}


def test_a_group_still_loading_its_engine_is_named_with_its_replica_states():
    status = _status({replica_deployment_name("fast"): _deployment({ReplicaState.RUNNING: 1}),
                      replica_deployment_name("slow"): _deployment({ReplicaState.STARTING: 1},
                                                                   DeploymentStatus.UPDATING, "loading")})
    problems = unready_groups(status, "tandem", ["fast", "slow"])
    assert list(problems) == ["slow"]
    assert problems["slow"] == "no replica is running (replicas: 1 STARTING; deployment UPDATING: loading)"


def test_a_group_not_required_is_not_checked_and_missing_pieces_are_named():
    status = _status({replica_deployment_name("fast"): _deployment({})})
    # "scaled" is autoscaled to zero: the ingress does not pass it as required.
    assert unready_groups(status, "tandem", ["fast"]) == {
        "fast": "no replica is running (replicas: none; deployment HEALTHY)"}
    assert unready_groups(status, "tandem", ["other"]) == {"other": "its deployment does not exist yet"}
    assert unready_groups(status, "elsewhere", ["fast"]) == {"fast": "the application 'elsewhere' is not deployed"}


def test_the_group_watch_reports_each_change_of_the_groups_without_a_running_replica():
    running = {replica_deployment_name("fast"): _deployment({ReplicaState.RUNNING: 1}),
               replica_deployment_name("slow"): _deployment({ReplicaState.RUNNING: 1})}
    lost = dict(running, **{replica_deployment_name("fast"): _deployment({ReplicaState.STARTING: 1})})
    views = [_status(running), _status(lost), _status(lost), RuntimeError("controller busy"), _status(running)]
    changes = []

    def status():
        view = views.pop(0)
        if isinstance(view, Exception):
            raise view
        return view

    watch = GroupWatch(status, "tandem", ["fast", "slow"], lambda groups, read_at: changes.append(groups),
                       interval_s=3600)  # checked by hand
    for _ in range(5):
        watch.check()
    watch.stop()
    # told once when fast lost its replica, kept through the failed read, told again when it came back
    assert changes == [{"fast"}, set()]
