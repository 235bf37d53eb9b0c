"""Protobuf's wire format by hand (varints, length-delimited fields): the kubelet's gRPC APIs need no generator."""

from __future__ import annotations

from collections.abc import Iterator


class ProtobufError(ValueError):
    """The bytes are not a valid protobuf message."""


def read_varint(data: bytes, position: int) -> tuple[int, int]:
    """The varint at `position` and the position after it."""
    result = shift = 0
    while True:
        if position >= len(data):
            raise ProtobufError("truncated varint")
        byte = data[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, position
        shift += 7
        if shift > 63:
            raise ProtobufError("varint too long")


def fields(data: bytes) -> Iterator[tuple[int, int, bytes | int]]:
    """Each field of a message as (number, wire type, value): an int for varints, bytes for length-delimited."""
    position = 0
    while position < len(data):
        key, position = read_varint(data, position)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, position = read_varint(data, position)
            yield number, wire, value
        elif wire == 2:
            length, position = read_varint(data, position)
            if position + length > len(data):
                raise ProtobufError("truncated field")
            yield number, wire, data[position:position + length]
            position += length
        elif wire == 1:
            position += 8
        elif wire == 5:
            position += 4
        else:
            raise ProtobufError(f"unsupported wire type {wire}")


def text(value: bytes | int) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def encode_varint(value: int) -> bytes:
    """A base-128 varint; a negative number as protobuf encodes an int64 (its 64-bit two's complement, ten
    bytes: before, a negative number never reached zero and the loop ran for ever). Beyond 64 bits: an error."""
    if not -(1 << 63) <= value < 1 << 64:
        raise ProtobufError(f"{value} does not fit a 64-bit varint")
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def length_field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (string, bytes, embedded message)."""
    return encode_varint(number << 3 | 2) + encode_varint(len(payload)) + payload


def varint_field(number: int, value: int) -> bytes:
    """A varint field (bool, int32, int64); proto3 leaves a zero out."""
    return encode_varint(number << 3) + encode_varint(value) if value else b""
