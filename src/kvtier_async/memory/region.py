"""The CPU tier's physical store: one shared, page-aligned mmap file per instance.

Theory of operation
-------------------
Every worker (TP rank, usually a separate process) of an engine instance maps the
same file, ``<directory>/kvtier_<instance_id>.mmap`` (``/dev/shm`` by default), so
a secondary tier in any process can read any slot without a copy. This module is the
mapping, `SharedRegion`; getting the file is the other modules' work:

- `kvtier_async.memory._create`: the creation race (one creator sizes the file, the others
  wait and check it) and each handle's place (*One owner*: a worker rank or the scheduler,
  claimed for as long as the handle maps the region).
- `kvtier_async.memory._reclaim`: a restart after a crash with the same ``instance_id``
  removes the dead creator's file, unless a live process still maps it.
- `kvtier_async.memory.stale`: finding and removing the files of dead creators with other
  ids; a creator sweeps its directory once.
- `kvtier_async.memory._files`: region file names, the shared ``flock`` every mapper holds
  (its descriptor stays open until the mapping is gone; a forked child shares it), removal.

*Layout.* A slot is padded to a page-aligned row of ``row_bytes`` and rows are
interleaved by worker: slot ``b`` of worker ``w`` is row ``b * num_workers + w``::

    w0_b0 | w1_b0 | ... | w{n-1}_b0 | w0_b1 | w1_b1 | ...

Every slot starts on a page boundary, so O_DIRECT reads may target it.

*Prefaulting.* Each worker pre-faults its own rows with
``madvise(MADV_POPULATE_WRITE)`` (one call when it is the only worker), falling
back on older kernels to a read-modify-write of one byte per page, which keeps
whatever a peer has already written.

*Views.* ``rows``, ``slot_view``, ``numpy`` and ``torch`` all alias the mapping
(checked against its address, never copied). Each one pins the mapping: a mapping
cannot be unmapped while any of them, or any slice of them, is alive, so callers
must drop them before :meth:`SharedRegion.close`, which otherwise raises
:class:`RegionInUseError` (after unlinking the file; call it again once the views
are gone).

*Clean-up.* The creator unlinks the file on close; peers keep their mappings
until they close. If the creator dies without closing, its reaper (a helper process per
creating process, :mod:`._reaper`) removes the file once no live process maps it. If the
reaper could not run, the file outlives its creator until it is reclaimed, or swept
(`kvtier_async.memory.stale`).
"""

from __future__ import annotations

import ctypes
import errno
import gc
import math
import mmap
import operator
import os
import time
import weakref
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Final

import numpy as np
import numpy.typing as npt

from kvtier_async import defaults
from kvtier_async._cudart import clear_last_error, runtime
from kvtier_async._log import get_logger
from kvtier_async._mounts import mount
from kvtier_async.memory import _reaper
from kvtier_async.memory._create import Layout, Role, claim, open_region
from kvtier_async.memory._files import check_instance_id, region_path, unlink_region
from kvtier_async.memory.errors import (
    RegionClaimedError,
    RegionError,
    RegionInUseError,
    RegionLayoutError,
    StaleRegionError,
)
from kvtier_async.memory.stale import find_stale_regions, remove_stale_regions, sweep

if TYPE_CHECKING:
    import torch

__all__ = [
    "RegionClaimedError",
    "RegionError",
    "RegionInUseError",
    "RegionLayoutError",
    "SharedRegion",
    "StaleRegionError",
    "close_region",
    "find_stale_regions",
    "region_path",
    "remove_stale_regions",
]

log = get_logger(__name__)

PAGE_SIZE: Final = mmap.PAGESIZE
# MADV_POPULATE_WRITE appeared in Linux 5.14; Python's mmap exports it from 3.13.
_MADV_POPULATE_WRITE: int = getattr(mmap, "MADV_POPULATE_WRITE", 23)
# Linux refuses a long-term pin of file-backed pages on a file system that tracks dirty
# pages (ext4, xfs, overlayfs... on 6.x kernels): only tmpfs and hugetlbfs regions pin.
_PIN_HINT = "put the region on tmpfs (region_dir on /dev/shm, the default) to pin it"


class SharedRegion:
    """One worker's handle on an instance's shared CPU region.

    Args:
        instance_id: Names the region; 1-200 characters from ``[A-Za-z0-9_.-]``.
        num_slots: Slots per worker (>= 1).
        slot_bytes: Usable bytes per slot (>= 1); rows are padded to whole pages.
        num_workers: Workers sharing the region (>= 1).
        worker_rank: This worker, ``0 <= worker_rank < num_workers``.
        directory: Where the file lives; ``/dev/shm`` keeps it in RAM.
        wait_timeout_s: How long a non-creator waits for the creator to size the file.
        role: Claim this handle's place, ``"worker"`` (at ``worker_rank``) or
            ``"scheduler"``, for as long as it maps the region (see *One owner* in
            `kvtier_async.memory._create`); None claims nothing.
        token: What every handle of one engine shares; a region created with another
            token is refused. None checks nothing.

    Raises:
        ValueError: An argument is invalid (the message names it).
        TimeoutError: The creator did not size the file within ``wait_timeout_s``.
        RegionLayoutError: The file was sized for a different configuration.
        StaleRegionError: The file's creator is dead but a live process still maps it.
        RegionError: The creator removed the file before sizing it, prefaulting failed, or
            the file is not this user's private regular file (a symbolic link, another
            owner, a mode wider than 0600).
        RegionClaimedError: The place ``role`` names is held by another live handle, or
            the region was created with another ``token``.
        OSError: The directory lacks space or permissions.
    """

    def __init__(
        self,
        instance_id: str,
        num_slots: int,
        slot_bytes: int,
        *,
        num_workers: int = 1,
        worker_rank: int = 0,
        directory: str | os.PathLike[str] = defaults.REGION_DIR,
        wait_timeout_s: float = 30.0,
        role: Role | None = None,
        token: str | None = None,
    ) -> None:
        self._instance_id = check_instance_id(instance_id)
        if role not in (None, "worker", "scheduler"):
            raise ValueError(f"role must be 'worker', 'scheduler' or None, got {role!r}")
        if token is not None and (not isinstance(token, str) or not token):
            raise ValueError(f"token must be a non-empty string or None, got {token!r}")
        self._num_slots = _check_int("num_slots", num_slots, low=1)
        self._slot_bytes = _check_int("slot_bytes", slot_bytes, low=1)
        self._num_workers = _check_int("num_workers", num_workers, low=1)
        self._rank = _check_int("worker_rank", worker_rank, low=0, high=self._num_workers)
        self._row_bytes = _round_up(self._slot_bytes, PAGE_SIZE)
        self._size = self._num_slots * self._num_workers * self._row_bytes
        self._path = region_path(_check_directory(directory), instance_id)
        deadline = time.monotonic() + _check_timeout(wait_timeout_s)
        self._closed = False
        self._cuda_registered = False
        self._pid = os.getpid()  # a forked child inherits the handle, not the ownership
        layout = Layout(self._num_slots, self._num_workers, self._row_bytes)
        fd, self._inode, self._creator = open_region(
            self._path, self._instance_id, layout, token, deadline
        )
        try:
            claim(fd, self._path, self._inode, self._instance_id, role, self._rank)
            self._mm: mmap.mmap | None = self._map(fd)
        except BaseException:
            if self._creator:
                self._unlink()
            os.close(fd)
            raise
        # The descriptor (and its shared lock) lives as long as the mapping: closed by
        # close(), or when the mapping is collected after its last view.
        self._release_fd = weakref.finalize(self._mm, os.close, fd)
        if self._creator:
            _reaper.watch(self._path, self._inode)  # removed even if this process is killed
            sweep(self._path.parent)
        self._address = _buffer_address(self._mm)
        log.info(
            "shared region ready",
            path=str(self._path),
            creator=self._creator,
            worker_rank=self._rank,
            size_bytes=self._size,
        )

    # -- properties -------------------------------------------------------------

    @property
    def instance_id(self) -> str:
        return self._instance_id

    @property
    def path(self) -> Path:
        return self._path

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    @property
    def row_bytes(self) -> int:
        """Bytes per row: ``slot_bytes`` rounded up to whole pages."""
        return self._row_bytes

    @property
    def num_workers(self) -> int:
        return self._num_workers

    @property
    def worker_rank(self) -> int:
        return self._rank

    @property
    def size_bytes(self) -> int:
        """Size of the file and mapping: ``num_slots * num_workers * row_bytes``."""
        return self._size

    @property
    def is_creator(self) -> bool:
        """Whether this handle created the file (and so unlinks it on close).

        Only in the creating process: a copy inherited through ``fork`` never unlinks.
        """
        return self._creator and os.getpid() == self._pid

    @property
    def is_cuda_registered(self) -> bool:
        return self._cuda_registered

    @property
    def closed(self) -> bool:
        return self._closed

    # -- zero-copy views --------------------------------------------------------

    @property
    def rows(self) -> memoryview:
        """Every worker's rows: shape ``(num_slots * num_workers, row_bytes)``, format ``B``.

        CPython cannot index a 2-D memoryview by row (``rows[r]`` raises
        NotImplementedError); use ``rows.cast("B")`` with byte offsets,
        ``np.asarray(rows)[r]``, or :meth:`slot_view` for this worker's slots.
        """
        return memoryview(self._mapping()).cast(
            "B", (self._num_slots * self._num_workers, self._row_bytes)
        )

    def slot_view(self, slot: int, *, padded: bool = False) -> memoryview:
        """This worker's slot ``slot``: ``slot_bytes`` long, or ``row_bytes`` if ``padded``.

        The padded view spans whole pages, as O_DIRECT reads and writes need.
        """
        start = self._slot_offset(slot)
        end = start + (self._row_bytes if padded else self._slot_bytes)
        return memoryview(self._mapping())[start:end]

    def slot_address(self, slot: int) -> int:
        """Virtual address of this worker's slot ``slot`` (page-aligned)."""
        offset = self._slot_offset(slot)
        self._mapping()
        return self._address + offset

    def numpy(self) -> npt.NDArray[np.uint8]:
        """This worker's slots as a ``(num_slots, slot_bytes)`` uint8 strided array."""
        arr: npt.NDArray[np.uint8] = np.ndarray(
            (self._num_slots, self._slot_bytes),
            dtype=np.uint8,
            buffer=self._mapping(),
            offset=self._rank * self._row_bytes,
            strides=(self._row_bytes * self._num_workers, 1),
        )
        _check_zero_copy("numpy()", arr.ctypes.data, self._address + self._rank * self._row_bytes)
        return arr

    def torch(self) -> torch.Tensor:
        """:meth:`numpy` as a CPU ``torch.uint8`` tensor over the same memory."""
        import torch

        tensor = torch.from_numpy(self.numpy())
        _check_zero_copy("torch()", tensor.data_ptr(), self._address + self._rank * self._row_bytes)
        return tensor

    # -- CUDA -------------------------------------------------------------------

    def register_cuda(self) -> bool:
        """Pin the whole mapping for DMA with ``cudaHostRegister``; True on success.

        Without CUDA this does nothing and returns False. A failed registration is
        logged and not fatal: copies still work, from pageable memory, more slowly.
        """
        self._mapping()
        if self._cuda_registered:
            return True
        cudart = runtime()
        if cudart is None:
            return False
        code = int(cudart.cudaHostRegister(self._address, self._size, 0))
        if code != 0:
            clear_last_error()  # else torch raises it after the caller's next kernel
            log.warning(
                "cudaHostRegister failed; copies will use pageable memory",
                path=str(self._path),
                code=code,
                file_system=mount(self._path)[1],
                hint=_PIN_HINT,
            )
            return False
        self._cuda_registered = True
        return True

    def _unregister_cuda(self) -> None:
        if not self._cuda_registered:
            return
        self._cuda_registered = False
        cudart = runtime()
        code = -1 if cudart is None else int(cudart.cudaHostUnregister(self._address))
        if code != 0:
            log.warning("cudaHostUnregister failed", path=str(self._path), code=code)

    # -- life cycle -------------------------------------------------------------

    def close(self) -> None:
        """Unregister, unlink (if creator) and unmap. Idempotent.

        Raises:
            RegionInUseError: Views of the mapping are still alive. The region is
                closed for new views and the file is already unlinked; drop the
                views and call ``close()`` again to unmap.
        """
        mm = self._mm
        if mm is None:
            return
        if not self._closed:
            self._closed = True
            self._unregister_cuda()
            if self.is_creator:
                self._unlink()
        try:
            mm.close()
        except BufferError as exc:
            raise RegionInUseError(
                f"cannot unmap {self._path}: memoryviews, numpy arrays or tensors "
                "obtained from this region (or slices of them) are still alive; "
                "drop them and call close() again"
            ) from exc
        self._mm = None
        self._release_fd()
        log.debug("shared region closed", path=str(self._path))

    def __enter__(self) -> SharedRegion:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"SharedRegion({self._instance_id!r}, num_slots={self._num_slots}, "
            f"slot_bytes={self._slot_bytes}, worker={self._rank}/{self._num_workers}, "
            f"creator={self._creator}, closed={self._closed})"
        )

    # -- internals --------------------------------------------------------------

    def _mapping(self) -> mmap.mmap:
        if self._closed or self._mm is None:
            raise ValueError(f"region {self._path} is closed")
        return self._mm

    def _slot_offset(self, slot: int) -> int:
        index = operator.index(slot)
        if isinstance(slot, bool) or not 0 <= index < self._num_slots:
            raise IndexError(f"slot {slot!r} out of range [0, {self._num_slots})")
        return (index * self._num_workers + self._rank) * self._row_bytes

    def _map(self, fd: int) -> mmap.mmap:
        mm = mmap.mmap(fd, self._size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            _prefault(mm, *self._own_rows())
        except BaseException:
            mm.close()
            raise
        return mm

    def _own_rows(self) -> tuple[int, int, int, int]:
        """This worker's rows as (first offset, stride, count, length)."""
        if self._num_workers == 1:
            return 0, self._size, 1, self._size
        stride = self._row_bytes * self._num_workers
        return self._rank * self._row_bytes, stride, self._num_slots, self._row_bytes

    def _unlink(self) -> None:
        """Remove the owner record, then the file (so no new creator races us)."""
        unlink_region(self._path, self._inode)


# -- closing -------------------------------------------------------------------


def close_region(region: SharedRegion) -> bool:
    """Close ``region``; views still held by dead frames (a cancelled job's traceback) are
    dropped by a collection first. Returns False, leaving the mapping to go with its last
    view, if some survive (the file is unlinked either way)."""
    try:
        region.close()
    except RegionInUseError:
        gc.collect()
        try:
            region.close()
        except RegionInUseError:
            log.warning(
                "region views outlive their owner; unmapped with the last one",
                path=str(region.path),
            )
            return False
    return True


# -- helpers ------------------------------------------------------------------


def _prefault(mm: mmap.mmap, first: int, stride: int, count: int, length: int) -> None:
    """Fault in ``count`` ranges of ``length`` bytes, ``stride`` apart, for writing."""
    try:
        mm.madvise(_MADV_POPULATE_WRITE, first, PAGE_SIZE)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise _prefault_error(exc) from exc
        log.warning("MADV_POPULATE_WRITE unsupported; prefaulting page by page")
        _touch_pages(mm, first, stride, count, length)
        return
    try:
        for i in range(count):
            mm.madvise(_MADV_POPULATE_WRITE, first + i * stride, length)
    except OSError as exc:
        raise _prefault_error(exc) from exc


def _touch_pages(mm: mmap.mmap, first: int, stride: int, count: int, length: int) -> None:
    """Read-modify-write one byte per page, keeping whatever is there."""
    pages: npt.NDArray[np.uint8] = np.ndarray(
        (count, length // PAGE_SIZE),
        dtype=np.uint8,
        buffer=mm,
        offset=first,
        strides=(stride, PAGE_SIZE),
    )
    try:
        pages |= 0
    finally:
        del pages


def _prefault_error(exc: OSError) -> RegionError:
    return RegionError(f"could not prefault the shared region (is the filesystem full?): {exc}")


def _buffer_address(mm: mmap.mmap) -> int:
    """Address of the mapping; the temporary buffer export is released at once."""
    anchor = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor


def _check_zero_copy(what: str, actual: int, expected: int) -> None:
    if actual != expected:
        raise RegionError(
            f"{what} made a copy (data at {actual:#x}, mapping at {expected:#x}); "
            "tiers require zero-copy access to the shared region"
        )


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _check_int(name: str, value: int, *, low: int, high: int | None = None) -> int:
    bound = f">= {low}" if high is None else f"with {low} <= {name} < {high}"
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or number < low or (high is not None and number >= high):
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")
    return number


def _check_directory(directory: str | os.PathLike[str]) -> Path:
    try:
        path = Path(directory)
    except TypeError:
        path = None
    if path is None or not path.is_dir():
        raise ValueError(f"directory must be an existing directory, got {directory!r}")
    return path


def _check_timeout(timeout_s: float) -> float:
    number = timeout_s if isinstance(timeout_s, int | float) else math.nan
    if isinstance(timeout_s, bool) or not math.isfinite(number) or number < 0:
        raise ValueError(f"wait_timeout_s must be a finite number >= 0, got {timeout_s!r}")
    return float(number)
