"""The PodResources client's protobuf wire helpers: varints as protobuf writes them."""

from __future__ import annotations

import pytest

from agent.protowire import ProtobufError, encode_varint, read_varint


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 2**32, 2**63 - 1, 2**64 - 1])
def test_a_varint_reads_back_as_written(value):
    """Each non-negative 64-bit value survives its wire form."""
    assert read_varint(encode_varint(value), 0) == (value, len(encode_varint(value)))


def test_a_negative_number_is_ten_bytes_as_protobuf_encodes_an_int64():
    """-1 is 0xff x9 then 0x01 (protobuf's int64 encoding), and reads back as its two's complement; it no
    longer loops for ever."""
    assert encode_varint(-1) == b"\xff" * 9 + b"\x01"
    assert read_varint(encode_varint(-2**63), 0) == (2**63, 10)


@pytest.mark.parametrize("value", [2**64, -(2**63) - 1])
def test_a_number_beyond_64_bits_is_one_clear_error(value):
    """Nothing a 64-bit varint can carry: an error, not a wrong encoding."""
    with pytest.raises(ProtobufError, match="does not fit a 64-bit varint"):
        encode_varint(value)
