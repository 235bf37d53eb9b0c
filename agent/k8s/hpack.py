"""HPACK (RFC 7541) for one HTTP/2 client: a full decoder (static and dynamic tables, Huffman) and a literal encoder."""

from __future__ import annotations

_STATIC = (
    (":authority", ""), (":method", "GET"), (":method", "POST"), (":path", "/"), (":path", "/index.html"),
    (":scheme", "http"), (":scheme", "https"), (":status", "200"), (":status", "204"), (":status", "206"),
    (":status", "304"), (":status", "400"), (":status", "404"), (":status", "500"), ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"), ("accept-language", ""), ("accept-ranges", ""), ("accept", ""),
    ("access-control-allow-origin", ""), ("age", ""), ("allow", ""), ("authorization", ""), ("cache-control", ""),
    ("content-disposition", ""), ("content-encoding", ""), ("content-language", ""), ("content-length", ""),
    ("content-location", ""), ("content-range", ""), ("content-type", ""), ("cookie", ""), ("date", ""),
    ("etag", ""), ("expect", ""), ("expires", ""), ("from", ""), ("host", ""), ("if-match", ""),
    ("if-modified-since", ""), ("if-none-match", ""), ("if-range", ""), ("if-unmodified-since", ""),
    ("last-modified", ""), ("link", ""), ("location", ""), ("max-forwards", ""), ("proxy-authenticate", ""),
    ("proxy-authorization", ""), ("range", ""), ("referer", ""), ("refresh", ""), ("retry-after", ""),
    ("server", ""), ("set-cookie", ""), ("strict-transport-security", ""), ("transfer-encoding", ""),
    ("user-agent", ""), ("vary", ""), ("via", ""), ("www-authenticate", ""),
)
#: RFC 7541 Appendix B as the code length of each symbol 0..256 (256 is EOS). The code is canonical (within
#: one length, codes ascend with the symbol), so the lengths alone give every code; tests check known codes.
_HUFFMAN_LENGTHS = (
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 30, 28, 28, 28, 28, 28,
    28, 28, 28, 28, 6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15,
    6, 12, 10, 13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6,
    15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6, 6, 5, 6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28, 20, 22, 20,
    20, 22, 22, 22, 23, 22, 23, 23, 23, 23, 23, 24, 23, 24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23,
    24, 22, 21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23, 21, 21, 22, 21, 23, 22, 23, 23, 20, 22, 22,
    22, 23, 22, 22, 23, 26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25, 19, 21, 26, 27, 27, 26, 27,
    24, 21, 21, 26, 26, 28, 27, 27, 27, 20, 24, 20, 21, 22, 21, 21, 23, 22, 22, 25, 25, 24, 24, 26, 23, 26, 27, 26,
    26, 27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26, 30,
)
EOS = 256
MAX_STRING = 64 * 1024


class HpackError(ValueError):
    """A header block that does not decode."""


def huffman_codes() -> dict[tuple[int, int], int]:
    """(length, code) -> symbol, built canonically from the code lengths."""
    codes: dict[tuple[int, int], int] = {}
    code, length = 0, 0
    for symbol in sorted(range(len(_HUFFMAN_LENGTHS)), key=lambda s: (_HUFFMAN_LENGTHS[s], s)):
        code <<= _HUFFMAN_LENGTHS[symbol] - length
        length = _HUFFMAN_LENGTHS[symbol]
        codes[(length, code)] = symbol
        code += 1
    return codes


_CODES = huffman_codes()


def huffman_decode(data: bytes) -> bytes:
    out = bytearray()
    code = length = 0
    for byte in data:
        for shift in range(7, -1, -1):
            code, length = (code << 1) | ((byte >> shift) & 1), length + 1
            symbol = _CODES.get((length, code))
            if symbol is not None:
                if symbol == EOS:
                    raise HpackError("Huffman string holds EOS")
                out.append(symbol)
                code = length = 0
            elif length > 30:
                raise HpackError("invalid Huffman code")
    if length > 7 or code != (1 << length) - 1:
        raise HpackError("invalid Huffman padding")
    return bytes(out)


def _integer(data: bytes, position: int, prefix_bits: int) -> tuple[int, int]:
    """The integer with an N-bit prefix at `position` and the position after it."""
    if position >= len(data):
        raise HpackError("truncated integer")
    mask = (1 << prefix_bits) - 1
    value, position = data[position] & mask, position + 1
    if value < mask:
        return value, position
    shift = 0
    while True:
        if position >= len(data) or shift > 28:
            raise HpackError("truncated or oversized integer")
        byte, position = data[position], position + 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, position


def _string(data: bytes, position: int) -> tuple[str, int]:
    if position >= len(data):
        raise HpackError("truncated string")
    huffman = bool(data[position] & 0x80)
    length, position = _integer(data, position, 7)
    if length > MAX_STRING or position + length > len(data):
        raise HpackError("truncated or oversized string")
    raw = data[position:position + length]
    return (huffman_decode(raw) if huffman else raw).decode("latin-1"), position + length


class Decoder:
    """One connection's decoding state: the dynamic table lives across header blocks."""

    def __init__(self, max_table_size: int = 4096) -> None:
        self.limit = max_table_size  # our SETTINGS_HEADER_TABLE_SIZE (the default, never changed)
        self.max_size = max_table_size
        self.table: list[tuple[str, str]] = []  # newest first
        self.size = 0

    def _field(self, index: int) -> tuple[str, str]:
        if 1 <= index <= len(_STATIC):
            return _STATIC[index - 1]
        if 0 <= index - len(_STATIC) - 1 < len(self.table):
            return self.table[index - len(_STATIC) - 1]
        raise HpackError(f"header index {index} out of range")

    def _add(self, name: str, value: str) -> None:
        self.table.insert(0, (name, value))
        self.size += len(name) + len(value) + 32
        self._evict()

    def _evict(self) -> None:
        while self.size > self.max_size and self.table:
            name, value = self.table.pop()
            self.size -= len(name) + len(value) + 32

    def decode(self, block: bytes) -> list[tuple[str, str]]:
        fields: list[tuple[str, str]] = []
        position = 0
        while position < len(block):
            byte = block[position]
            if byte & 0x80:  # indexed field
                index, position = _integer(block, position, 7)
                fields.append(self._field(index))
                continue
            if byte & 0xE0 == 0x20:  # dynamic table size update
                size, position = _integer(block, position, 5)
                if size > self.limit:
                    raise HpackError(f"table size {size} over {self.limit}")
                self.max_size = size
                self._evict()
                continue
            indexing = bool(byte & 0x40)  # else without indexing (0000) or never indexed (0001)
            index, position = _integer(block, position, 6 if indexing else 4)
            if index:
                name = self._field(index)[0]
            else:
                name, position = _string(block, position)
            value, position = _string(block, position)
            if indexing:
                self._add(name, value)
            fields.append((name, value))
        return fields


def _encode_integer(value: int, prefix_bits: int, first: int = 0) -> bytes:
    mask = (1 << prefix_bits) - 1
    if value < mask:
        return bytes([first | value])
    out, value = bytearray([first | mask]), value - mask
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode(fields: list[tuple[str, str]]) -> bytes:
    """A header block of literal fields without indexing, literal names, no Huffman: no state to share."""
    out = bytearray()
    for name, value in fields:
        out.append(0)
        for text in (name.encode("latin-1"), value.encode("latin-1")):
            out += _encode_integer(len(text), 7) + text
    return bytes(out)
