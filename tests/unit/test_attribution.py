"""Charging an Xid to its workload: the owner (controller or image), never one process or pod at a time."""

from agent.sources.attribution import PodAttribution, owner_key, workload_key


def test_every_pod_of_a_deployment_is_one_workload():
    first = owner_key("ml", owner_kind="ReplicaSet", owner_name="trainer-5d9c7b8f6d")
    rolled = owner_key("ml", owner_kind="ReplicaSet", owner_name="trainer-7c4bd9f58x")
    assert first == rolled == "ml/Deployment/trainer"


def test_every_job_of_a_cronjob_is_one_workload():
    assert owner_key("ml", owner_kind="Job", owner_name="nightly-28934400") == "ml/CronJob/nightly"
    assert owner_key("ml", owner_kind="Job", owner_name="finetune") == "ml/Job/finetune"


def test_a_bare_pod_is_its_image_whatever_the_tag():
    assert owner_key("ml", image="nvcr.io/nvidia/pytorch:24.05-py3") == owner_key(
        "ml", image="nvcr.io/nvidia/pytorch:24.07-py3@sha256:abc") == "image/nvcr.io/nvidia/pytorch"
    assert owner_key("ml", image="registry:5000/team/app") == "image/registry:5000/team/app"


def test_a_pod_is_charged_to_its_owner():
    pod = PodAttribution("0f9a5c0e-1234-5678-9abc-def012345678")
    owners = {pod.pod_uid: "ml/Job/finetune"}
    assert workload_key(pod=pod, owners=owners, process="python3") == "ml/Job/finetune"


def test_a_pod_whose_owner_is_not_known_yet_is_charged_to_itself():
    pod = PodAttribution("0f9a5c0e-1234-5678-9abc-def012345678")
    assert workload_key(pod=pod, owners={}, process="python3") == "pod/0f9a5c0e-1234-5678-9abc-def012345678"


def test_a_process_outside_any_pod_is_its_name_never_its_pid():
    """Three short-lived processes of one program are one workload, not three."""
    assert workload_key(pod=None, owners={}, process="python3") == "process/python3"
    assert workload_key(pod=None, owners={}, process=None) == ""
