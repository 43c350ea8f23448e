"""The fs tier's batches on the C path (`kvtier_async.tiers.fs.native`), from the Python side:
a `NativeBatch` holds one store or load batch, the blocks' arrays for ``struct store_args`` /
``struct load_args`` and their header pages, and reads each result back as the Python path
would report it. A tier's `BlockFiles` (`kvtier_async.tiers.fs.files`) fills a batch and
applies its results.

A store's header page holds the header fields Python packed (`blockfile.pack_fields`, payload
sum zero); C fills in the payload and header checksums. A load gets the expected header
fields of each key (`blockfile.FIELDS_BYTES` each) and a page to read the header into; a
failed check comes back as its ``LOAD_*`` code and becomes the `CorruptBlockError` that
`blockfile.verify_block` raises for it, so both paths say the same. The header pages are
this thread's (`scratch_pages`), and a batch holds a buffer export of every block while C
works on it, so no block memory can be unmapped under it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from kvtier_async.tiers.blockfile import (
    FIELDS_BYTES,
    HEADER_BYTES,
    VERDICTS,
    CorruptBlockError,
    pack_fields,
    short_file,
    stored_length,
    wrong_length,
    wrong_size,
)
from kvtier_async.tiers.fs.blockio import O_DIRECT, aligned, anchored_address, open_problem
from kvtier_async.tiers.fs.native import FsIo, LoadArgs, Pool, StoreArgs
from kvtier_async.tiers.fs.native_source import (
    LOAD_BAD_HEADER,
    LOAD_BAD_LENGTH,
    LOAD_BAD_PAYLOAD,
    LOAD_BAD_SIZE,
    LOAD_FOREIGN,
    LOAD_MISSING,
    LOAD_OK,
    LOAD_SHORT,
    LOAD_WRONG_KEY,
    STEP_OPEN,
)
from kvtier_async.tiers.fs.publish import Perms
from kvtier_async.tiers.fs.tempfiles import temp_name

__all__ = ["NativeBatch", "Pages", "scratch_pages"]

# The check of `blockfile.verify_block` that each load result stands for.
_CHECKS: Final = {
    LOAD_BAD_HEADER: "header_sum",
    LOAD_FOREIGN: "format",
    LOAD_WRONG_KEY: "key",
    LOAD_BAD_PAYLOAD: "payload",
}
_scratch = threading.local()


class NativeBatch:
    """The blocks of one call into the C helper: their places in the caller's lists, and their
    arguments. Holds a buffer export of every block until it is dropped, so that no block
    memory can be unmapped while C works on it."""

    def __init__(self) -> None:
        self.indexes: list[int] = []
        self.keys: list[bytes] = []
        self.paths: list[str] = []
        self.dirs: list[str] = []
        self.noted: list[int] = []
        self._bodies: list[int] = []
        self._flags: list[int] = []
        self._check: list[int] = []
        self._anchors: list[object] = []
        self._nbytes = 0

    def add(
        self,
        index: int,
        key: bytes,
        block: memoryview,
        path: str,
        *,
        directory: str = "",
        check: bool = False,
        direct: bool,
    ) -> None:
        """Add a block; a store needs ``directory`` (where its temporary goes) and ``check``
        (look for a complete file first)."""
        address, anchor = anchored_address(block)
        is_aligned = aligned(block.nbytes, address)
        self.indexes.append(index)
        self.keys.append(key)
        self.paths.append(path)
        self.dirs.append(directory)
        self.noted.append(0)
        self._bodies.append(address)
        self._flags.append(O_DIRECT if direct and is_aligned else 0)
        self._check.append(int(check))
        self._anchors.append(anchor)
        self._nbytes = block.nbytes

    def fill_headers(self, heads: Pages) -> None:
        """Write each block's header fields (payload sum zero) at the start of its page."""
        for j, key in enumerate(self.keys):
            self._pack_prefix(heads.mapping, j * HEADER_BYTES, key)

    def _pack_prefix(self, buffer: mmap.mmap | bytearray, offset: int, key: bytes) -> None:
        pack_fields(buffer, offset, key, self._nbytes, 0)  # the C loop fills in the sum

    def store(
        self,
        fsio: FsIo,
        pool: Pool | None,
        heads: Pages,
        fsync: bool,
        perms: Perms,
        subset: Sequence[int],
    ) -> list[tuple[int, int]]:
        """Store the blocks at positions ``subset``: ``(result, failed step)`` for each."""
        count = len(subset)
        c_temps = _c_array(ctypes.c_char_p, [
            os.fsencode(os.path.join(self.dirs[j], temp_name("blk"))) for j in subset
        ])  # fmt: skip
        c_finals = _c_array(ctypes.c_char_p, [os.fsencode(self.paths[j]) for j in subset])
        c_check = _c_array(ctypes.c_int32, [self._check[j] for j in subset])
        c_heads = _c_array(ctypes.c_void_p, [heads.address + j * HEADER_BYTES for j in subset])
        c_bodies = _c_array(ctypes.c_void_p, [self._bodies[j] for j in subset])
        c_flags = _c_array(ctypes.c_int32, [self._flags[j] for j in subset])
        result, step, noted = (_c_array(ctypes.c_int32, [0] * count) for _ in range(3))
        args = StoreArgs(
            count, _at(c_temps), _at(c_finals), _at(c_check), _at(c_heads), _at(c_bodies),
            _at(c_flags), self._nbytes, int(fsync), perms.file, int(perms.fix), _at(result),
            _at(step), _at(noted),
        )  # fmt: skip
        fsio.run(pool, args)
        for k, j in enumerate(subset):
            self.noted[j] = noted[k]
        return list(zip(result, step, strict=True))

    def load(
        self, fsio: FsIo, pool: Pool | None, heads: Pages
    ) -> list[tuple[int, Exception | None, tuple[int, int] | None]]:
        """Load every block: ``(result, the problem, (device, inode) of the file read)``."""
        count = len(self.keys)
        expect = bytearray(FIELDS_BYTES * count)
        for j, key in enumerate(self.keys):
            self._pack_prefix(expect, j * FIELDS_BYTES, key)
        c_expect = (ctypes.c_char * len(expect)).from_buffer(expect)
        c_paths = _c_array(ctypes.c_char_p, [os.fsencode(path) for path in self.paths])
        c_heads = _c_array(
            ctypes.c_void_p, [heads.address + j * HEADER_BYTES for j in range(count)]
        )
        c_bodies = _c_array(ctypes.c_void_p, self._bodies)
        c_flags = _c_array(ctypes.c_int32, self._flags)
        result, step = _c_array(ctypes.c_int32, [0] * count), _c_array(ctypes.c_int32, [0] * count)
        got = _c_array(ctypes.c_int64, [0] * count)
        dev, ino = _c_array(ctypes.c_uint64, [0] * count), _c_array(ctypes.c_uint64, [0] * count)
        args = LoadArgs(
            count, _at(c_paths), _at(c_heads), _at(c_bodies), _at(c_flags),
            ctypes.addressof(c_expect), self._nbytes, _at(result), _at(step), _at(got), _at(dev),
            _at(ino),
        )  # fmt: skip
        fsio.run(pool, args)
        del c_expect
        outcomes: list[tuple[int, Exception | None, tuple[int, int] | None]] = []
        for j in range(count):
            code = result[j]
            if code in (LOAD_OK, LOAD_MISSING):
                outcomes.append((code, None, None))
                continue
            problem = self._problem(code, got[j], heads, j)
            identity = None if step[j] == STEP_OPEN else (dev[j], ino[j])
            outcomes.append((code, problem, identity))
        return outcomes

    def _problem(self, code: int, got: int, heads: Pages, j: int) -> Exception:
        """The error the Python path raises for load result ``code``."""
        if code < 0:
            return open_problem(OSError(-code, os.strerror(-code), self.paths[j]))
        if code == LOAD_SHORT:
            return short_file(got, HEADER_BYTES + self._nbytes)
        if code == LOAD_BAD_SIZE:
            return wrong_size(got, HEADER_BYTES + self._nbytes)
        if code == LOAD_BAD_LENGTH:
            length = stored_length(heads.mapping, j * HEADER_BYTES)
            return wrong_length(length, self._nbytes)
        check = _CHECKS.get(code)
        return CorruptBlockError(VERDICTS[check] if check else f"unknown load result {code}")


@dataclass
class Pages:
    """A thread's page-aligned header pages for the C path (an anonymous mapping)."""

    mapping: mmap.mmap
    address: int
    count: int


def scratch_pages(kind: str, count: int) -> Pages:
    """This thread's ``kind`` pages ("store" or "load": a store page is zero past the
    header fields, a load page holds whatever was read), at least ``count`` of them."""
    pages: Pages | None = getattr(_scratch, kind, None)
    if pages is None or pages.count < count:
        size = 1 << max(4, (count - 1).bit_length())
        mapping = mmap.mmap(-1, size * HEADER_BYTES)
        anchor = ctypes.c_char.from_buffer(mapping)
        address = ctypes.addressof(anchor)
        del anchor
        pages = Pages(mapping, address, size)
        setattr(_scratch, kind, pages)
    return pages


def _c_array(ctype: Any, values: Sequence[Any]) -> ctypes.Array[Any]:
    """A C array of ``ctype`` holding ``values`` (it keeps byte strings alive)."""
    array: ctypes.Array[Any] = (ctype * len(values))(*values)
    return array


def _at(array: ctypes.Array[Any]) -> int:
    return ctypes.addressof(array)
