"""The block file format, shared by the fs tier (a file per block) and the obj tier (an object
per block), and the name of a block below a tier's root.

A block file is one `HEADER_BYTES` header page, then the payload (``block_bytes``). The page
starts with the fields of `FIELDS` (little-endian, no padding): the magic, the format version,
a reserved field, the header size, the payload length, the payload checksum, the checksum of
the key and the checksum's name; the rest is zero but for the page's last 8 bytes, a checksum
of everything before them (`HEADER_SUM_AT`). The payload starts page-aligned, so an O_DIRECT
``preadv`` fills [a page-aligned header buffer, the slot] in one call and a ``pwritev`` writes
both from there: no staging copy.

A reader checks, in this order, and fails with the first verdict that applies (`VERDICTS`):
the header checksum, then every field of each check in `COMPARED` (``format``: the magic,
version, header size and checksum name; ``length``; ``key``), then the payload checksum. The
reserved field is not checked. `verify_block` is that reader; the fs tier's C batch path
(`kvtier_async.tiers.fs.native_source`) performs the same checks, with every offset and size
taken from `c_defines`, which the C source is assembled from before it is compiled: a change
of the layout here reaches the C side (and the build cache key) without an edit there.

*Names.* Block ``key`` lives at `block_relpath` below a tier's root (fs: a directory, obj: a
bucket prefix): ``<model>_<digest>/r<rank>/<hhh>/<hh>_g<group>/<hex key>.bin``, hex digits
and the sanitised namespace only, so no key can escape the root; `block_key` inverts it.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from kvtier_async.ledger import make_offload_key, split_offload_key
from kvtier_async.tiers.checksum import CHECKSUM_NAME, checksum

if TYPE_CHECKING:
    from kvtier_async.tiers.base import TierContext

__all__ = [
    "COMPARED",
    "FIELDS",
    "FIELDS_BYTES",
    "FILE_VERSION",
    "HEADER_BYTES",
    "HEADER_SUM_AT",
    "MAGIC",
    "PAYLOAD_SUM_AT",
    "VERDICTS",
    "CorruptBlockError",
    "Field",
    "block_key",
    "block_relpath",
    "c_defines",
    "field",
    "pack_fields",
    "pack_header",
    "short_file",
    "stored_length",
    "verify_block",
    "wrong_length",
    "wrong_size",
]

HEADER_BYTES: Final = 4096
MAGIC: Final = b"KVTIERB\x00"
FILE_VERSION: Final = 1


@dataclass(frozen=True)
class Field:
    """One header field: its `struct` code, where it is, and which check compares it
    (``None``: not compared; ``payload``: against the payload's checksum)."""

    name: str
    code: str
    offset: int
    size: int
    check: str | None


def _layout(*specs: tuple[str, str, str | None]) -> tuple[Field, ...]:
    fields, offset = [], 0
    for name, code, check in specs:
        size = struct.calcsize(f"<{code}")
        fields.append(Field(name, code, offset, size, check))
        offset += size
    return tuple(fields)


# The header fields, in order; a check's fields are compared with those of the expected header.
FIELDS: Final = _layout(
    ("magic", "8s", "format"),
    ("version", "H", "format"),
    ("reserved", "H", None),
    ("header_bytes", "I", "format"),
    ("payload_bytes", "Q", "length"),
    ("payload_sum", "Q", "payload"),
    ("key_sum", "Q", "key"),
    ("checksum_name", "16s", "format"),
)
# The checks that compare stored fields with expected ones, in the order a reader makes them.
COMPARED: Final = ("format", "length", "key")
_HEADER: Final = struct.Struct("<" + "".join(f.code for f in FIELDS))
_SUM: Final = struct.Struct("<Q")
FIELDS_BYTES: Final = _HEADER.size
HEADER_SUM_AT: Final = HEADER_BYTES - _SUM.size
_SUM_NAME: Final = CHECKSUM_NAME.encode().ljust(16, b"\0")
_ZERO_PAGE: Final = bytes(HEADER_BYTES)
_INDEX: Final = {f.name: i for i, f in enumerate(FIELDS)}
_BY_CHECK: Final = {
    check: [_INDEX[f.name] for f in FIELDS if f.check == check] for check in COMPARED
}


def field(name: str) -> Field:
    """The header field called ``name``."""
    return FIELDS[_INDEX[name]]


PAYLOAD_SUM_AT: Final = field("payload_sum").offset

# What each failed check says ("length": `wrong_length`), on every path that reads blocks.
VERDICTS: Final = {
    "header_sum": "header checksum mismatch",
    "format": "not a block file of this format",
    "key": "the file belongs to another key",
    "payload": "payload checksum mismatch",
}


class CorruptBlockError(ValueError):
    """A block file is short, malformed or fails its checksum."""


def short_file(got: int, expected: int) -> CorruptBlockError:
    return CorruptBlockError(f"short file: read {got} of {expected} bytes")


def wrong_length(length: int, expected: int) -> CorruptBlockError:
    return CorruptBlockError(f"payload is {length} bytes, expected {expected}")


def wrong_size(size: int, expected: int) -> CorruptBlockError:
    return CorruptBlockError(f"file is {size} bytes, expected {expected}")


# -- writing and reading a header ------------------------------------------------------------


def pack_header(page: memoryview, key: bytes, payload: memoryview) -> None:
    """Fill ``page`` (`HEADER_BYTES` long) with the header of ``key``'s block ``payload``."""
    page[:] = _ZERO_PAGE
    pack_fields(page, 0, key, payload.nbytes, checksum(payload))
    _SUM.pack_into(page, HEADER_SUM_AT, checksum(page[:HEADER_SUM_AT]))


def pack_fields(
    buffer: memoryview | bytearray | mmap.mmap,
    offset: int,
    key: bytes,
    payload_bytes: int,
    payload_sum: int,
) -> None:
    """The header's fields (`FIELDS_BYTES` of them) for ``key`` at ``offset`` of ``buffer``."""
    _HEADER.pack_into(buffer, offset, *_values(key, payload_bytes, payload_sum))


def _values(key: bytes, payload_bytes: int, payload_sum: int) -> tuple[object, ...]:
    return (MAGIC, FILE_VERSION, 0, HEADER_BYTES, payload_bytes, payload_sum, checksum(key),
            _SUM_NAME)  # fmt: skip


def verify_block(page: memoryview, key: bytes, payload: memoryview) -> None:
    """Raise `CorruptBlockError` unless ``page`` is a valid header for ``key``'s ``payload``."""
    (header_sum,) = _SUM.unpack_from(page, HEADER_SUM_AT)
    if checksum(page[:HEADER_SUM_AT]) != header_sum:
        raise CorruptBlockError(VERDICTS["header_sum"])
    found = _HEADER.unpack_from(page)
    wanted = _values(key, payload.nbytes, 0)
    for check in COMPARED:
        if any(found[i] != wanted[i] for i in _BY_CHECK[check]):
            raise _mismatch(check, found, payload.nbytes)
    if checksum(payload) != found[_INDEX["payload_sum"]]:
        raise CorruptBlockError(VERDICTS["payload"])


def _mismatch(check: str, found: tuple[object, ...], payload_bytes: int) -> CorruptBlockError:
    if check == "length":
        length = found[_INDEX["payload_bytes"]]
        assert isinstance(length, int)
        return wrong_length(length, payload_bytes)
    return CorruptBlockError(VERDICTS[check])


def stored_length(buffer: memoryview | bytearray | mmap.mmap, offset: int = 0) -> int:
    """The payload length the header at ``offset`` of ``buffer`` claims."""
    length: int = _HEADER.unpack_from(buffer, offset)[_INDEX["payload_bytes"]]
    return length


# -- the layout for C --------------------------------------------------------------------------


def c_defines() -> str:
    """The layout as C preprocessor lines: ``KVB_<FIELD>_AT``/``_SIZE`` for every field,
    ``KVB_HEADER_BYTES``, ``KVB_FIELDS_BYTES``, ``KVB_HEADER_SUM_AT``/``_SIZE``, and for
    each check in `COMPARED` ``KVB_DIFFERS_<CHECK>(h, w)``: whether header ``h`` differs
    from the expected fields ``w`` in that check's fields (``memcmp``)."""
    return "\n".join(_c_lines()) + "\n"


def _c_lines() -> Iterator[str]:
    yield "/* The block file layout, generated from kvtier_async.tiers.blockfile. */"
    yield "#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__"
    yield '#error "block files are little-endian; this helper writes sums in host order"'
    yield "#endif"
    yield f"#define KVB_HEADER_BYTES {HEADER_BYTES}"
    yield f"#define KVB_FIELDS_BYTES {FIELDS_BYTES}"
    yield f"#define KVB_HEADER_SUM_AT {HEADER_SUM_AT}"
    yield f"#define KVB_HEADER_SUM_SIZE {_SUM.size}"
    for f in FIELDS:
        yield f"#define KVB_{f.name.upper()}_AT {f.offset}"
        yield f"#define KVB_{f.name.upper()}_SIZE {f.size}"
    for check in COMPARED:
        tests = " || ".join(
            f"memcmp((h) + KVB_{f.name.upper()}_AT, (w) + KVB_{f.name.upper()}_AT, "
            f"KVB_{f.name.upper()}_SIZE)"
            for f in FIELDS
            if f.check == check
        )
        yield f"#define KVB_DIFFERS_{check.upper()}(h, w) ({tests})"


# -- names -----------------------------------------------------------------------------------


def block_relpath(ctx: TierContext, key: bytes) -> str:
    """``<model>_<digest>/r<rank>/<hhh>/<hh>_g<group>/<hex key>.bin``, hex names only."""
    block_hash, group = split_offload_key(key)
    hexkey = block_hash.hex()
    return f"{ctx.namespace}/r{ctx.rank}/{hexkey[:3]}/{hexkey[3:5]}_g{group}/{hexkey}.bin"


def block_key(path: str) -> bytes | None:
    """The key of the block file at ``path`` (the inverse of `block_relpath`); None if
    ``path`` is not named like one."""
    directory, name = os.path.split(path)
    hexkey, dot, ext = name.rpartition(".")
    _, sep, group = os.path.basename(directory).rpartition("_g")
    try:
        if not (dot and ext == "bin" and sep):
            return None
        return make_offload_key(bytes.fromhex(hexkey), int(group))
    except ValueError:
        return None
