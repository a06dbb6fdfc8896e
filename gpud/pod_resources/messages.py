"""The kubelet's PodResources List answer (gpud/device_plugin/podresources.proto, k8s.io/kubelet
pkg/apis/podresources/v1/api.proto), read from protobuf's wire format
(https://protobuf.dev/programming-guides/encoding/) without the protobuf library: only the fields the
labels need; any other field, known or added later, is skipped as the wire format allows."""

from __future__ import annotations

from dataclasses import dataclass


class MalformedAnswer(ValueError):
    """Bytes that are not a ListPodResourcesResponse."""


@dataclass(frozen=True)
class ClaimResource:  # ClaimResource: driver_name 2, pool_name 3, device_name 4
    driver: str
    pool: str
    device: str


@dataclass(frozen=True)
class DynamicResource:  # DynamicResource: claim_name 2, claim_namespace 3, claim_resources 4
    claim_name: str
    claim_namespace: str
    resources: tuple[ClaimResource, ...]


@dataclass(frozen=True)
class ContainerDevices:  # ContainerDevices: resource_name 1, device_ids 2
    resource: str
    ids: tuple[str, ...]


@dataclass(frozen=True)
class Container:  # ContainerResources: name 1, devices 2, dynamic_resources 5
    name: str
    devices: tuple[ContainerDevices, ...]
    dynamic: tuple[DynamicResource, ...]


@dataclass(frozen=True)
class Pod:  # PodResources: name 1, namespace 2, containers 3
    name: str
    namespace: str
    containers: tuple[Container, ...]


VARINT, I64, LEN, I32 = 0, 1, 2, 5


def _fields(data: bytes) -> dict[int, list]:
    """Field number -> its values in order: ints for VARINT/I64/I32, bytes for LEN."""
    found: dict[int, list] = {}
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise MalformedAnswer("field number 0")
        if wire == VARINT:
            value, at = _varint(data, at)
        elif wire in (I64, I32):
            size = 8 if wire == I64 else 4
            if at + size > len(data):
                raise MalformedAnswer("the message ends inside a fixed-size field")
            value, at = int.from_bytes(data[at:at + size], "little"), at + size
        elif wire == LEN:
            size, at = _varint(data, at)
            if at + size > len(data):
                raise MalformedAnswer("the message ends inside a length-delimited field")
            value, at = data[at:at + size], at + size
        else:  # groups (3, 4) are not in proto3; 6 and 7 are no wire type
            raise MalformedAnswer(f"wire type {wire}")
        found.setdefault(number, []).append(value)
    return found


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise MalformedAnswer("the message ends inside a varint, or it is longer than 10 bytes")
        byte, at = data[at], at + 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def _string(fields: dict[int, list], number: int) -> str:
    values = fields.get(number) or [b""]
    if not isinstance(values[-1], bytes):  # proto3: the last value of a scalar field wins
        raise MalformedAnswer(f"field {number} is not a string")
    try:
        return values[-1].decode("utf-8")
    except UnicodeDecodeError:
        raise MalformedAnswer(f"field {number} is not UTF-8") from None


def _messages(fields: dict[int, list], number: int) -> list[dict[int, list]]:
    values = fields.get(number, [])
    if not all(isinstance(value, bytes) for value in values):
        raise MalformedAnswer(f"field {number} is not a message")
    return [_fields(value) for value in values]


def _strings(fields: dict[int, list], number: int) -> tuple[str, ...]:
    return tuple(_string({number: [value]}, number) for value in fields.get(number, []))


def parse_list_answer(data: bytes) -> tuple[Pod, ...]:
    """ListPodResourcesResponse (pod_resources 1) -> its pods. MalformedAnswer where it is not one."""
    return tuple(Pod(_string(pod, 1), _string(pod, 2), tuple(
        Container(_string(container, 1),
                  tuple(ContainerDevices(_string(devices, 1), _strings(devices, 2))
                        for devices in _messages(container, 2)),
                  tuple(DynamicResource(_string(dynamic, 2), _string(dynamic, 3), tuple(
                      ClaimResource(_string(claim, 2), _string(claim, 3), _string(claim, 4))
                      for claim in _messages(dynamic, 4)))
                        for dynamic in _messages(container, 5)))
        for container in _messages(pod, 3)))
        for pod in _messages(_fields(data), 1))
