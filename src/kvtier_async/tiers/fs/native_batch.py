"""The fs tier's batches on the C path (`kvtier_async.tiers.fs.native`), from the Python side:
`store_batch` and `load_batch` run one store or load batch of a tier's `BlockFiles`, each a
`NativeBatch`: the blocks' arrays for ``struct store_args`` / ``struct load_args``, their
header pages, and each result read back as the Python path would report it.

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
import errno
import mmap
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

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
    STEP_NAMES,
    STEP_OPEN,
    STORE_FAILED,
    STORE_PRESENT,
    STORE_WRITTEN,
)
from kvtier_async.tiers.fs.publish import Perms
from kvtier_async.tiers.fs.records import REMOVED_DAMAGED
from kvtier_async.tiers.fs.tempfiles import temp_name

if TYPE_CHECKING:
    from kvtier_async.tiers.fs.files import BlockFiles

__all__ = ["NativeBatch", "Pages", "load_batch", "scratch_pages", "store_batch"]

# The check of `blockfile.verify_block` that each load result stands for.
_CHECKS: Final = {
    LOAD_BAD_HEADER: "header_sum",
    LOAD_FOREIGN: "format",
    LOAD_WRONG_KEY: "key",
    LOAD_BAD_PAYLOAD: "payload",
}
# A store's result when its temporary could not be created for lack of a directory.
_GONE: Final = (-errno.ENOENT, STEP_OPEN)
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


# -- a store or load batch of a tier -----------------------------------------------------------


def store_batch(
    files: BlockFiles, fsio: FsIo, keys: Sequence[bytes], blocks: Sequence[memoryview]
) -> list[int]:
    """`BlockFiles.store_many` through the C loop: Python prepares names, directories and
    headers, C stores, Python applies the results (access record, removals, warnings)."""
    outcomes = [STORE_FAILED] * len(keys)
    batch = _stores(files, keys, blocks)
    if not batch.indexes:
        return outcomes
    heads = scratch_pages("store", len(batch.indexes))
    batch.fill_headers(heads)
    results = _run_stores(files, fsio, batch, heads)
    for j, (code, step) in enumerate(results):
        index, path = batch.indexes[j], batch.paths[j]
        if batch.noted[j]:
            files.warn("fs block file had the wrong size or was a link, replaced it",
                       path=path)  # fmt: skip
            files.removed.add(batch.keys[j], REMOVED_DAMAGED)
        if code == STORE_WRITTEN:
            outcomes[index] = STORE_WRITTEN
        elif code == STORE_PRESENT:
            files.touch(path)
            outcomes[index] = STORE_PRESENT
        else:
            files.forget(path)
            call = STEP_NAMES.get(step, "store")
            error = OSError(-code, f"{call}: {os.strerror(-code)}", path)
            files.store_failed(keys[index], error)
    return outcomes


def _stores(files: BlockFiles, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> NativeBatch:
    """The batch of the blocks that may be stored (the others fail here); their directories
    exist."""
    wanted: list[tuple[int, bytes, memoryview, str, str]] = []
    for index, (key, block) in enumerate(zip(keys, blocks, strict=True)):
        try:
            files.check_block(block)
            path = files.path(key)
        except (OSError, ValueError) as exc:
            files.store_failed(key, exc)
            continue
        wanted.append((index, key, block, path, os.path.dirname(path)))
    made, failed = files.dirs.ensure_many(directory for *_, directory in wanted)
    batch = NativeBatch()
    for index, key, block, path, directory in wanted:
        error = failed.get(directory)
        if error is not None:
            files.store_failed(key, error)
            continue
        new_dir = directory in made  # a new directory holds no block: no lstat first
        made.discard(directory)
        batch.add(
            index, key, block, path, directory=directory, check=not new_dir,
            direct=files.mode.direct,
        )  # fmt: skip
    return batch


def _run_stores(
    files: BlockFiles, fsio: FsIo, batch: NativeBatch, heads: Pages
) -> list[tuple[int, int]]:
    """Store every block of ``batch``: ``(result, failed step)`` each. With ``max_bytes``,
    one block at a time, so that evictions never hit a block of this batch; blocks whose
    directories vanished under us are tried once more after making them again."""
    pool = files.workers.pool("write")
    if files.usage is None:
        everything = range(len(batch.indexes))
        results = batch.store(fsio, pool, heads, files.fsync, files.perms, everything)
    else:
        results = []
        for j, path in enumerate(batch.paths):
            try:
                files.evict(files.usage.admit(path, files.file_bytes))
            except OSError as exc:  # a block file larger than max_bytes
                results.append((-(exc.errno or errno.EIO), 0))
                continue
            results += batch.store(fsio, pool, heads, files.fsync, files.perms, [j])
    retry = [j for j, (code, step) in enumerate(results) if (code, step) == _GONE]
    if retry:  # forget the directories known, make them, once more
        files.dirs.forget()
        try:
            for j in retry:
                files.dirs.ensure(batch.dirs[j])
        except OSError as exc:
            files.warn("fs tier cannot make its directories again", tier=files.name,
                       error=str(exc))  # fmt: skip
        again = batch.store(fsio, pool, heads, files.fsync, files.perms, retry)
        for j, result in zip(retry, again, strict=True):
            results[j] = result
    return results


def load_batch(
    files: BlockFiles, fsio: FsIo, keys: Sequence[bytes], blocks: Sequence[memoryview]
) -> list[int]:
    """`BlockFiles.load_many` through the C loop, with the checks of `verify_block`."""
    outcomes = [0] * len(keys)
    batch = NativeBatch()
    for index, (key, block) in enumerate(zip(keys, blocks, strict=True)):
        try:
            files.check_block(block, into=True)
            path = files.path(key)
        except ValueError as exc:
            files.refuse_load(key, exc)
            continue
        batch.add(index, key, block, path, direct=files.mode.direct)
    if not batch.indexes:
        return outcomes
    heads = scratch_pages("load", len(batch.indexes))
    pool = files.workers.pool("read")
    for j, (code, problem, identity) in enumerate(batch.load(fsio, pool, heads)):
        path = batch.paths[j]
        if code == LOAD_OK:
            files.touch(path)
            outcomes[batch.indexes[j]] = 1
        elif problem is not None:  # not a plain miss
            files.fail_load(batch.keys[j], path, identity, problem)
    return outcomes
