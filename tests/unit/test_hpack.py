"""HPACK decoding (agent.k8s.hpack) against RFC 7541's own examples and code table."""

import pytest

from agent.k8s import hpack

# RFC 7541 C.6: three responses on one connection, Huffman-coded, with a 256-octet dynamic table that evicts.
C6 = [
    ("488264025885aec3771a4b6196d07abe941054d444a8200595040b8166e082a62d1bff6e919d29ad171863c78f0b97c8e9ae82ae43d3",
     [(":status", "302"), ("cache-control", "private"), ("date", "Mon, 21 Oct 2013 20:13:21 GMT"),
      ("location", "https://www.example.com")], 222),
    ("4883640effc1c0bf",
     [(":status", "307"), ("cache-control", "private"), ("date", "Mon, 21 Oct 2013 20:13:21 GMT"),
      ("location", "https://www.example.com")], 222),
    ("88c16196d07abe941054d444a8200595040b8166e084a62d1bffc05a839bd9ab77ad94e7821dd7f2e6c7b335dfdfcd5b3960d5af27087f36"
     "72c1ab270fb5291f9587316065c003ed4ee5b1063d5007",
     [(":status", "200"), ("cache-control", "private"), ("date", "Mon, 21 Oct 2013 20:13:22 GMT"),
      ("location", "https://www.example.com"), ("content-encoding", "gzip"),
      ("set-cookie", "foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1")], 215),
]


def test_the_rfc_response_examples_decode_with_their_dynamic_table():
    """C.6.1-C.6.3: later blocks index entries of earlier ones, and the table evicts to its 256 octets."""
    decoder = hpack.Decoder(max_table_size=256)
    for block, fields, table_size in C6:
        assert decoder.decode(bytes.fromhex(block)) == fields
        assert decoder.size == table_size
    assert [name for name, _ in decoder.table] == ["set-cookie", "content-encoding", "date"]


def test_the_huffman_code_is_rfc_7541_appendix_b():
    """The canonical code built from the lengths is complete and gives the RFC's codes for sample symbols."""
    codes = {symbol: key for key, symbol in hpack.huffman_codes().items()}
    assert sum(2.0 ** -length for length, _ in codes.values()) == 1.0
    assert codes[ord("0")] == (5, 0x0) and codes[ord("a")] == (5, 0x3) and codes[ord(" ")] == (6, 0x14)
    assert codes[ord("X")] == (8, 0xFC) and codes[ord("Y")] == (7, 0x73) and codes[ord("`")] == (15, 0x7FFD)
    assert codes[0] == (13, 0x1FF8) and codes[10] == (30, 0x3FFFFFFC) and codes[128] == (20, 0xFFFE6)
    assert codes[255] == (26, 0x3FFFFEE) and codes[hpack.EOS] == (30, 0x3FFFFFFF)
    assert hpack.huffman_decode(bytes.fromhex("f1e3c2e5f23a6ba0ab90f4ff")) == b"www.example.com"  # C.4.1


@pytest.mark.parametrize("data", [b"\xf1\xe3\xc2\xe5\xf2\x3a\x6b\xa0\xab\x90\xf4\xfe", b"\xff\xff\xff\xff"],
                         ids=["padding-not-ones", "eos-in-string"])
def test_a_bad_huffman_string_is_refused(data):
    """Padding that is not EOS's prefix, or EOS itself in the string, is an HpackError."""
    with pytest.raises(hpack.HpackError):
        hpack.huffman_decode(data)


@pytest.mark.parametrize("block", ["c0", "3fe21f", "00"], ids=["index-out-of-range", "table-size-over-limit",
                                                                "truncated"])
def test_a_bad_header_block_is_refused(block):
    """An index past both tables, a table size over our limit or a cut block is an HpackError."""
    with pytest.raises(hpack.HpackError):
        hpack.Decoder().decode(bytes.fromhex(block))


def test_what_the_client_encodes_decodes_without_touching_the_table():
    """The request's literal-without-indexing block decodes to the same fields and adds nothing to the table."""
    fields = [(":method", "POST"), (":path", "/v1.PodResourcesLister/List"), ("x-long", "v" * 300)]
    decoder = hpack.Decoder()
    assert decoder.decode(hpack.encode(fields)) == fields
    assert decoder.table == []
