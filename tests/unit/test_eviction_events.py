"""The EvictedForGpuFault Event an eviction owes: one per pod incarnation, naming the pod's uid."""

from agent.model import Step, StepKind, frozen_attrs
from agent.remediation.record import OwedEvent


def evict(uid: str) -> Step:
    return Step(StepKind.EVICT, "ml/trainer-0", "holds faulty GPU 3: Xid 79", rule_id="xid-79", gpu_key="gpu-3",
                details=frozen_attrs({"pod_uid": uid} if uid else {}))


def test_two_incarnations_of_one_pod_name_owe_two_events():
    """A pod recreated under the same name and evicted again gets its own Event name, not a 409 on the last."""
    assert OwedEvent.for_eviction(evict("uid-a"), pending=False).id != \
        OwedEvent.for_eviction(evict("uid-b"), pending=False).id


def test_the_pending_and_the_due_event_of_one_eviction_are_one_event():
    """Held back until the pod is gone, then due: the same id, so it is delivered once."""
    assert OwedEvent.for_eviction(evict("uid-a"), pending=True).id == \
        OwedEvent.for_eviction(evict("uid-a"), pending=False).id


def test_the_event_regards_the_pod_by_its_uid():
    """`kubectl describe pod` selects Events by the pod's uid: the owed Event's step carries it."""
    event = OwedEvent.for_eviction(evict("uid-a"), pending=False)
    assert event.step().details["target_uid"] == "uid-a"
    assert event.step().target == "pod/ml/trainer-0"


def test_the_pods_uid_survives_the_durable_record():
    """Owed across a restart: the uid is kept in the record's JSON."""
    event = OwedEvent.for_eviction(evict("uid-a"), pending=True)
    assert OwedEvent.from_dict(event.to_dict()) == event


def test_an_eviction_without_a_known_uid_keeps_its_old_event_id():
    """A pod whose uid nobody knew (local mode) owes the Event under the id earlier versions gave it."""
    old = Step(StepKind.EVENT, "pod/ml/trainer-0", "holds faulty GPU 3: Xid 79", rule_id="xid-79", gpu_key="gpu-3",
               details=frozen_attrs({"reason": "EvictedForGpuFault", "type": "Warning"}))
    assert OwedEvent.for_eviction(evict(""), pending=False).id == OwedEvent.of(old, salt="evicted").id
