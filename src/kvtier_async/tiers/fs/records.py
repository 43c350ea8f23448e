"""What the fs tier records about its files: the access record for ``max_bytes`` (`Usage`), the
keys of the block files it deleted on its own (`Removed`), what its failed stores said
(`StoreErrors`), and the scan of its rank directory at open that seeds them (`scan`).

*Capacity.* With ``max_bytes`` the tier keeps its own access record (stores and loads, not
lookups; never ``atime``), rebuilt at ``open`` from a scan of its rank directory ordered by
``mtime``, and deletes least-recently-used files before a store would exceed the limit. The
record covers what this process has seen: blocks a live peer adds later count once this
process touches them. Without ``max_bytes`` nothing is deleted but corrupt files.

*Removals are reported.* Every block file the tier deletes on its own (it failed
verification on a load, was a wrong-sized file or a link found by a store, or was evicted
for ``max_bytes``) is counted by reason and its key queued for ``FsTier.take_removed`` (the
owner turns them into KV events; at most `REMOVED_QUEUE` keys wait, older ones are dropped
and counted).

*A full disk shows.* A store that fails with ``ENOSPC`` or ``EDQUOT`` is counted apart, and
the error of the last failed store (``ENOSPC``, ``EACCES``...) is kept until a later store
writes a block, so ``statistics()`` tells whether the tier is failing for lack of space.

Each record is thread-safe: the tier's worker threads share it.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import stat
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

from kvtier_async._beneath import LinkBelowRootError, entries, walk
from kvtier_async.tiers.blockfile import block_key
from kvtier_async.tiers.fs.tempfiles import TEMP_RE

__all__ = [
    "REMOVED_DAMAGED",
    "REMOVED_EVICTED",
    "REMOVED_QUEUE",
    "Removed",
    "StoreErrors",
    "Usage",
    "scan",
]

# Keys of removed blocks waiting for `FsTier.take_removed`; beyond it the oldest are dropped.
REMOVED_QUEUE: Final = 1 << 16
REMOVED_DAMAGED, REMOVED_EVICTED = "damaged", "evicted"
_NO_SPACE: Final = frozenset({errno.ENOSPC, errno.EDQUOT})


class Removed:
    """Keys of block files the tier deleted on its own, for `FsTier.take_removed`, and
    counts by reason."""

    def __init__(self) -> None:
        self._keys: collections.deque[bytes] = collections.deque()
        self._lock = threading.Lock()
        self.counts = {REMOVED_DAMAGED: 0, REMOVED_EVICTED: 0}
        self.dropped = 0

    def add(self, key: bytes, reason: str) -> None:
        with self._lock:
            self.counts[reason] += 1
            if len(self._keys) >= REMOVED_QUEUE:
                self._keys.popleft()
                self.dropped += 1
            self._keys.append(key)

    def add_paths(self, paths: Sequence[str], reason: str) -> None:
        for path in paths:
            key = block_key(path)
            if key is not None:
                self.add(key, reason)

    def take(self) -> list[bytes]:
        with self._lock:
            keys = list(self._keys)
            self._keys.clear()
        return keys


class StoreErrors:
    """Why stores failed: how many for lack of space, and the error of the last failed
    store (``""`` once a later store wrote a block)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.no_space = 0
        self.last = ""

    def failed(self, exc: Exception) -> None:
        code = exc.errno if isinstance(exc, OSError) else None
        name = errno.errorcode.get(code, "") if code is not None else ""
        with self._lock:
            self.no_space += code in _NO_SPACE
            self.last = name or type(exc).__name__

    def wrote(self) -> None:
        with self._lock:
            self.last = ""


class Usage:
    """The LRU access record for ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.used = 0
        self.evicted = 0
        self._files: OrderedDict[str, int] = OrderedDict()  # path -> bytes, LRU first
        self._lock = threading.Lock()

    def describe(self) -> str:
        return f"{self.used}/{self.max_bytes}B evicted={self.evicted}"

    def seed(self, files: Sequence[tuple[int, str, int]]) -> None:
        for _mtime, path, size in sorted(files):
            self.touch(path, size)

    def touch(self, path: str, size: int) -> None:
        with self._lock:
            if path in self._files:
                self._files.move_to_end(path)
            else:
                self._files[path] = size
                self.used += size

    def forget(self, path: str) -> None:
        with self._lock:
            self.used -= self._files.pop(path, 0)

    def admit(self, path: str, size: int) -> list[str]:
        """Record ``path`` as newest; return the files to delete to stay under the limit."""
        if size > self.max_bytes:
            raise OSError(errno.EFBIG, f"a block file of {size} bytes exceeds max_bytes")
        self.touch(path, size)
        return self.trim()

    def trim(self) -> list[str]:
        with self._lock:
            victims = []
            while self.used > self.max_bytes and len(self._files) > 1:
                victim, size = self._files.popitem(last=False)
                self.used -= size
                victims.append(victim)
            self.evicted += len(victims)
            return victims


def scan(
    root: str, namespace: str, rank_name: str, *, want_blocks: bool
) -> tuple[list[tuple[int, str, int]], list[str]]:
    """Block files ``(mtime_ns, path, size)`` (if wanted) and temporaries of the rank
    directory ``root/namespace/rank_name`` (the namespace's own temporaries too), in one
    walk through directory descriptors (`kvtier_async._beneath`): a link below ``root`` is
    never entered, so nothing outside the root is ever counted (or later deleted)."""
    temps = []
    with contextlib.suppress(FileNotFoundError, LinkBelowRootError):
        for name, st in entries(root, namespace):
            if TEMP_RE.fullmatch(name) and not stat.S_ISDIR(st.st_mode):
                temps.append(f"{root}/{namespace}/{name}")
    blocks = []
    for relpath, st in walk(root, f"{namespace}/{rank_name}"):
        name = relpath.rpartition("/")[2]
        path = f"{root}/{relpath}"
        if TEMP_RE.fullmatch(name):
            temps.append(path)
        elif want_blocks and name.endswith(".bin") and stat.S_ISREG(st.st_mode):
            blocks.append((st.st_mtime_ns, path, st.st_size))
    return blocks, temps
