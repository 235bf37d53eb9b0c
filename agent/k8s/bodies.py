"""The Kubernetes bodies the agent reads and writes, as TypedDicts: the fields it uses, each one optional."""

from __future__ import annotations

from typing import TypedDict, cast

from agent.k8s.raw import JsonDocument

# Every TypedDict is total=False: the API server may leave out any field, and the agent reads each with .get.


class OwnerReference(TypedDict, total=False):
    apiVersion: str
    kind: str
    name: str
    uid: str
    controller: bool


class ObjectMeta(TypedDict, total=False):
    name: str
    generateName: str
    namespace: str
    uid: str
    resourceVersion: str
    labels: dict[str, str]
    annotations: dict[str, str]
    ownerReferences: list[OwnerReference]
    deletionTimestamp: str


class ListMeta(TypedDict, total=False):
    resourceVersion: str


class Taint(TypedDict, total=False):
    key: str
    value: str
    effect: str
    timeAdded: str


class NodeCondition(TypedDict, total=False):
    type: str
    status: str
    reason: str
    message: str
    lastHeartbeatTime: str
    lastTransitionTime: str


class NodeSpec(TypedDict, total=False):
    taints: list[Taint]
    unschedulable: bool


class NodeStatus(TypedDict, total=False):
    conditions: list[NodeCondition]
    capacity: dict[str, str]
    allocatable: dict[str, str]


class Node(TypedDict, total=False):
    apiVersion: str
    kind: str
    metadata: ObjectMeta
    spec: NodeSpec
    status: NodeStatus


class NodeList(TypedDict, total=False):
    metadata: ListMeta
    items: list[Node]


class MetadataPatch(TypedDict, total=False):
    """A strategic-merge patch of metadata: None removes a label or annotation."""

    resourceVersion: str
    labels: dict[str, str | None]
    annotations: dict[str, str | None]


class NodeSpecPatch(TypedDict, total=False):
    """None removes the field (the taint list, or unschedulable to uncordon)."""

    taints: list[Taint] | None
    unschedulable: bool | None


#: A strategic-merge directive that deletes one condition by its type ("$patch" is no identifier).
ConditionDirective = TypedDict("ConditionDirective", {"type": str, "$patch": str})


class NodeStatusPatch(TypedDict, total=False):
    conditions: list[NodeCondition | ConditionDirective]


class NodePatch(TypedDict, total=False):
    """A strategic-merge patch of a Node (or of its status subresource)."""

    metadata: MetadataPatch
    spec: NodeSpecPatch
    status: NodeStatusPatch


class ResourceRequirements(TypedDict, total=False):
    limits: dict[str, str]
    requests: dict[str, str]


class Container(TypedDict, total=False):
    name: str
    image: str
    resources: ResourceRequirements


class PodSpec(TypedDict, total=False):
    nodeName: str
    containers: list[Container]
    initContainers: list[Container]


class PodStatus(TypedDict, total=False):
    phase: str


class Pod(TypedDict, total=False):
    """The fields of a Pod the agent reads (the pod finder, cleanup's agent pods)."""

    metadata: ObjectMeta
    spec: PodSpec
    status: PodStatus


class PodList(TypedDict, total=False):
    metadata: ListMeta
    items: list[Pod]


class Preconditions(TypedDict, total=False):
    """DeleteOptions.preconditions: the delete (or eviction) applies only to the object with this uid."""

    uid: str


class DeleteOptions(TypedDict, total=False):
    """meta/v1 DeleteOptions, the part an eviction sends."""

    preconditions: Preconditions


class Eviction(TypedDict, total=False):
    """policy/v1 Eviction: the body POSTed to a pod's eviction subresource."""

    apiVersion: str
    kind: str
    metadata: ObjectMeta
    deleteOptions: DeleteOptions


class ObjectReference(TypedDict, total=False):
    """What an Event is about (`regarding`): the Node or a Pod."""

    apiVersion: str
    kind: str
    name: str
    namespace: str
    uid: str


class EventSeries(TypedDict):
    count: int
    lastObservedTime: str


class Event(TypedDict, total=False):
    """events.k8s.io/v1 Event, as the agent creates it."""

    apiVersion: str
    kind: str
    metadata: ObjectMeta
    eventTime: str
    reportingController: str
    reportingInstance: str
    action: str
    reason: str
    type: str
    note: str
    regarding: ObjectReference
    series: EventSeries


class EventPatch(TypedDict):
    """The merge patch that folds a repeat into an Event's series."""

    series: EventSeries


class LeaseSpec(TypedDict, total=False):
    """coordination.k8s.io/v1 Lease spec: the leader election's and the budget slots' holder and times."""

    holderIdentity: str
    leaseDurationSeconds: int
    acquireTime: str
    renewTime: str
    leaseTransitions: int


class Lease(TypedDict, total=False):
    apiVersion: str
    kind: str
    metadata: ObjectMeta
    spec: LeaseSpec


class LeasePatch(TypedDict, total=False):
    """A JSON merge patch of a Lease (a budget slot's renewal, re-take, release): None removes an annotation."""

    metadata: MetadataPatch
    spec: LeaseSpec


class ConfigMap(TypedDict, total=False):
    """A v1 ConfigMap (the fleet's holds, as the controller writes them)."""

    apiVersion: str
    kind: str
    metadata: ObjectMeta
    data: dict[str, str]


def as_node(document: JsonDocument) -> Node:
    """A Node as the API server answered it (unchecked: the agent reads every field with a default)."""
    return cast(Node, document)


def as_pod_list(document: JsonDocument) -> PodList:
    """A PodList as the API server answered it (unchecked, as as_node)."""
    return cast(PodList, document)


def as_node_list(document: JsonDocument) -> NodeList:
    """A NodeList as the API server answered it (unchecked, as as_node)."""
    return cast(NodeList, document)
