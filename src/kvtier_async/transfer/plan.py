"""Copy plans: a transfer's specs turned into (source, destination, size) byte triples.

`plan_transfer` maps a (GPUSpec, CPUSpec) pair onto addresses using the canonical views
and the slot layout (`kvtier_async.transfer.canonical`), vectorised with numpy: one triple
per page run, in group -> view -> block order so that neighbouring blocks of one view sit
next to each other. `CopyPlan.merged` then joins triples that continue each other on both
sides (consecutive block ids of a view whose pages are back to back, filling consecutive
pages of a slot), so a batch of contiguous blocks becomes one copy.

`Planner` gives the merged plan of a handler's transfers (one set of caches, slot layout,
host slots and direction) in one call into C (``kvtier_plan`` in ``_batch_copy.c``, with
the GIL held: its work is shorter than a hand-off of the GIL beside a busy scheduler
thread) where every group's views hold a page in one run, else `plan_transfer` and
`CopyPlan.merged`; a transfer the C planner refuses (an id out of range, specs that do not
match) is planned again in numpy, which says what is wrong. A small transfer's plan is the
fixed cost of every job: numpy's ~25 operations cost 20-45 us where the C call costs a few
(``kvtier bench copy``'s plan rows). ``KVTIER_NATIVE_COPY=0`` switches it off with the
batch copy.

Every id is bounds-checked here, before any address is formed: the copy paths write raw
memory.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

from kvtier_async._log import get_logger
from kvtier_async._native import BUILD_ERRORS, disabled, load_library
from kvtier_async.ledger import CPUSpec, GPUSpec

from .canonical import CanonicalKV, SlotLayout

if TYPE_CHECKING:
    import torch

    from kvtier_async.memory import SharedRegion

__all__ = ["NATIVE_MODULE", "CopyPlan", "HostSlots", "Planner", "native_planning", "plan_transfer"]

log = get_logger(__name__)

IntArray = npt.NDArray[np.int64]

NATIVE_MODULE: Final = "kvtier_async.transfer._batch_copy"  # _batch_copy.c, built with the package


@dataclass(frozen=True, slots=True, eq=False)
class CopyPlan:
    """Byte copies: ``size[i]`` bytes from address ``src[i]`` to address ``dst[i]``."""

    src: IntArray
    dst: IntArray
    size: IntArray
    joined: bool = False  # no run continues the one before it (`merged` has nothing to do)

    def __len__(self) -> int:
        return len(self.size)

    @property
    def total_bytes(self) -> int:
        return int(self.size.sum())

    @property
    def max_size(self) -> int:
        return int(self.size.max()) if len(self.size) else 0

    def merged(self) -> CopyPlan:
        """The same copies with each run of continuing triples joined into one."""
        src, dst, size = self.src, self.dst, self.size
        if self.joined or len(size) <= 1:
            return self
        breaks = src[1:] != src[:-1] + size[:-1]
        breaks |= dst[1:] != dst[:-1] + size[:-1]
        (after,) = np.nonzero(breaks)
        if len(after) == len(breaks):
            return CopyPlan(src, dst, size, joined=True)  # nothing continues anything
        starts = np.empty(len(after) + 1, dtype=np.int64)
        starts[0] = 0
        starts[1:] = after + 1
        return CopyPlan(src[starts], dst[starts], np.add.reduceat(size, starts), joined=True)

    @classmethod
    def empty(cls) -> CopyPlan:
        none = np.empty(0, dtype=np.int64)
        return cls(none, none, none)


@dataclass(frozen=True, eq=False)
class HostSlots:
    """The CPU tier's slots as raw memory: slot ``s`` starts at ``address + s * stride``.

    ``keepalive`` is a tensor or numpy array over the slots; while it lives, the memory
    cannot be unmapped (a `SharedRegion` refuses to close), so drop the handlers that hold
    this before closing the region. A region's slots are a numpy array, so that a host-only
    process never imports torch for them (seconds of a cache's open); `flat` makes the
    tensor the device paths need.
    """

    address: int
    stride: int
    num_slots: int
    slot_bytes: int
    pinned: bool
    keepalive: torch.Tensor | npt.NDArray[np.uint8]

    @classmethod
    def from_region(cls, region: SharedRegion) -> HostSlots:
        """This worker's slots of a shared region (pinned if it is CUDA-registered)."""
        return cls(
            address=region.slot_address(0),
            stride=region.row_bytes * region.num_workers,
            num_slots=region.num_slots,
            slot_bytes=region.slot_bytes,
            pinned=region.is_cuda_registered,
            keepalive=region.numpy(),
        )

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor, *, pinned: bool | None = None) -> HostSlots:
        """Slots as the rows of a CPU ``(num_slots, slot_bytes)`` one-byte tensor."""
        if tensor.dim() != 2 or tensor.element_size() != 1 or tensor.stride(1) != 1:
            raise ValueError(
                "host slots must be a 2-D one-byte tensor with contiguous rows, got shape "
                f"{tuple(tensor.shape)}, strides {tensor.stride()}, dtype {tensor.dtype}"
            )
        if tensor.device.type != "cpu":
            raise ValueError(f"host slots must be on the CPU, got {tensor.device}")
        return cls(
            address=int(tensor.data_ptr()),
            stride=int(tensor.stride(0)),
            num_slots=int(tensor.shape[0]),
            slot_bytes=int(tensor.shape[1]),
            pinned=bool(tensor.is_pinned()) if pinned is None else pinned,
            keepalive=tensor,
        )

    @property
    def span(self) -> int:
        """Bytes from slot 0's first byte to the last slot's last byte."""
        return (self.num_slots - 1) * self.stride + self.slot_bytes

    def flat(self) -> torch.Tensor:
        """A 1-D uint8 tensor over ``[address, address + span)`` (zero-copy)."""
        import torch

        base = self.keepalive
        if isinstance(base, np.ndarray):
            base = torch.from_numpy(base)
        flat = torch.as_strided(base.view(torch.uint8), (self.span,), (1,))
        if flat.data_ptr() != self.address:
            raise RuntimeError("host slot view is not zero-copy")
        return flat


def plan_transfer(
    kv: CanonicalKV,
    layout: SlotLayout,
    host: HostSlots,
    gpu: GPUSpec,
    cpu: CPUSpec,
    *,
    to_host: bool,
) -> CopyPlan:
    """The byte copies of one transfer between device blocks and host slots.

    For group ``g`` with ``n`` GPU blocks and first-block index ``k``, GPU block ``i`` of
    the group is logical page ``j = k % F + i`` of the group's slots: page ``j % F`` of slot
    ``j // F``; the group takes ``ceil((k % F + n) / F)`` slots off the CPU spec, in order.

    A group whose views each hold a page in one run (every layout but LHBNC) is planned in
    a few whole-group numpy operations over per-view tables built once per (caches, slot
    layout): the cost per transfer does not grow with the number of layers. It runs on the
    engine's threads, beside the scheduler, for every job.

    Raises:
        ValueError: The specs do not match each other, the groups, or the id ranges.
    """
    if len(gpu.group_sizes) != len(kv.groups):
        raise ValueError(
            f"the GPU spec has {len(gpu.group_sizes)} groups, the KV caches {len(kv.groups)}"
        )
    block_ids = np.asarray(gpu.block_ids, dtype=np.int64).reshape(-1)  # no int32 overflow
    slot_ids = np.asarray(cpu.slot_ids, dtype=np.int64).reshape(-1)
    _check_ids("CPU slot id", slot_ids, host.num_slots)
    tables = _group_tables(kv, layout)
    factor = layout.factor
    dev_parts: list[IntArray] = []
    host_parts: list[IntArray] = []
    size_parts: list[IntArray] = []
    block_pos = slot_pos = 0
    for group, (count, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices, strict=True)):
        if count == 0:
            continue
        skip = first % factor
        num_slots = -(-(skip + count) // factor)
        if slot_pos + num_slots > len(slot_ids) or block_pos + count > len(block_ids):
            break  # reported below
        blocks = block_ids[block_pos : block_pos + count]
        slots = slot_ids[slot_pos : slot_pos + num_slots]
        if factor == 1:
            slot_base, position = host.address + slots * host.stride, None
        else:
            logical = skip + np.arange(count, dtype=np.int64)
            slot_base = host.address + slots[logical // factor] * host.stride
            position = logical % factor
        table = tables[group]
        if len(blocks) and int(blocks.view(np.uint64).max()) >= table.min_blocks:
            for index in kv.groups[group]:  # name the first view the bad id does not fit
                view = kv.views[index]
                _check_ids(f"GPU block id (group {group}, {view.name})", blocks, view.num_blocks)
        if table.one_run:
            # Every view of the group at once, view-major (the per-view order below).
            dev = table.address[:, None] + blocks[None, :] * table.block_stride[:, None]
            hst = slot_base[None, :] + table.offset[:, None]
            if position is not None:
                hst = hst + position[None, :] * table.page_size[:, None]
            dev_parts.append(dev.reshape(-1))
            host_parts.append(hst.reshape(-1))
            size_parts.append(np.repeat(table.page_size, count))
        else:
            for index in kv.groups[group]:
                view = kv.views[index]
                dev = view.address + blocks * view.block_stride
                hst = slot_base + layout.offsets[index]
                if position is not None:
                    hst = hst + position * view.page_size
                if view.is_contiguous_page:
                    dev_parts.append(dev)
                    host_parts.append(hst)
                    size_parts.append(np.full(count, view.page_size, dtype=np.int64))
                else:
                    before = np.cumsum(view.run_sizes) - view.run_sizes
                    dev_parts.append((dev[:, None] + view.run_offsets[None, :]).ravel())
                    host_parts.append((hst[:, None] + before[None, :]).ravel())
                    size_parts.append(np.tile(view.run_sizes, count))
        block_pos += count
        slot_pos += num_slots
    if block_pos != len(block_ids) or slot_pos != len(slot_ids):
        raise ValueError(
            f"specs do not match: group sizes {gpu.group_sizes} with block indices "
            f"{gpu.block_indices} and factor {factor} need {_slots_needed(gpu, factor)} slots "
            f"for {sum(gpu.group_sizes)} GPU blocks; got {len(slot_ids)} slots and "
            f"{len(block_ids)} GPU blocks"
        )
    if not size_parts:
        return CopyPlan.empty()
    if len(size_parts) == 1:
        dev_all, host_all, sizes = dev_parts[0], host_parts[0], size_parts[0]
    else:
        dev_all, host_all = np.concatenate(dev_parts), np.concatenate(host_parts)
        sizes = np.concatenate(size_parts)
    src, dst = (dev_all, host_all) if to_host else (host_all, dev_all)
    return CopyPlan(src, dst, sizes)


class Planner:
    """The merged plans of one handler's transfers: ``planner(gpu, cpu)`` is
    ``plan_transfer(kv, layout, host, gpu, cpu, to_host=to_host).merged()`` (see the module
    docstring for how). Holds ``host``'s memory while it lives, as its handler does."""

    __slots__ = (
        "_groups", "_host", "_kv", "_layout", "_meta", "_native", "_spans", "_to_host", "_widest"
    )  # fmt: skip

    def __init__(
        self, kv: CanonicalKV, layout: SlotLayout, host: HostSlots, *, to_host: bool
    ) -> None:
        self._kv, self._layout, self._host, self._to_host = kv, layout, host, to_host
        tables = _group_tables(kv, layout)
        function = _native_plan() if all(table.one_run for table in tables) else None
        self._native = function
        meta = [len(tables), layout.factor, host.address, host.stride, host.num_slots, to_host]
        for table in tables:
            meta += [len(table.address), table.min_blocks]
            for row in zip(
                table.address, table.block_stride, table.page_size, table.offset, strict=True
            ):
                meta += [int(value) for value in row]
        self._meta = (ctypes.c_int64 * len(meta))(*meta)  # read by C on every call
        # The type of a call's (count, first index) per group: made per call, not kept, so
        # that threads planning at once never share one.
        self._spans = ctypes.c_int64 * (2 * len(tables))
        self._groups = len(tables)
        # The most runs a transfer of n blocks can have: n per view of its widest group.
        self._widest = max((len(table.address) for table in tables), default=0)

    @property
    def native(self) -> bool:
        """Whether plans are made in C (else in numpy)."""
        return self._native is not None

    def __call__(self, gpu: GPUSpec, cpu: CPUSpec) -> CopyPlan:
        function = self._native
        blocks, slots = gpu.block_ids, cpu.slot_ids
        sizes, firsts = gpu.group_sizes, gpu.block_indices
        if (
            function is None
            or len(sizes) != self._groups
            or blocks.dtype is not _INT64
            or slots.dtype is not _INT64
        ):
            return self._numpy(gpu, cpu)
        if len(sizes) == 1:
            spans = self._spans(sizes[0], firsts[0])
        else:
            spans = self._spans(*(v for pair in zip(sizes, firsts, strict=True) for v in pair))
        cap = self._widest * len(blocks)
        out = np.empty(3 * cap, dtype=np.int64)
        try:  # a pointer to each array's first id (~0.3 us; ndarray.ctypes.data costs 1.2)
            first_block = _FIRST(blocks)
            first_slot = _FIRST(slots)
            first_out = _FIRST(out)
        except (TypeError, ValueError, BufferError):  # empty, read-only or strided: numpy's
            return self._numpy(gpu, cpu)
        runs = function(
            self._meta, spans, first_block, len(blocks), first_slot, len(slots), first_out, cap
        )
        if runs < 0:
            return self._numpy(gpu, cpu)  # raises what is wrong (or plans what C refused)
        return CopyPlan(out[:runs], out[cap : cap + runs], out[2 * cap : 2 * cap + runs], True)

    def _numpy(self, gpu: GPUSpec, cpu: CPUSpec) -> CopyPlan:
        kv, layout, host = self._kv, self._layout, self._host
        return plan_transfer(kv, layout, host, gpu, cpu, to_host=self._to_host).merged()


def native_planning() -> bool:
    """Whether `Planner` can plan in C in this process (built, loaded, not switched off)."""
    return _native_plan() is not None


@functools.cache
def _native_plan() -> Callable[..., int] | None:
    if disabled("KVTIER_NATIVE_COPY"):
        return None
    try:
        library = load_library(NATIVE_MODULE)
    except BUILD_ERRORS as exc:
        log.info("native planning unavailable; plans are made in numpy", error=str(exc))
        return None
    try:  # the same library, called with the GIL held (see the module docstring)
        function = ctypes.PyDLL(NATIVE_MODULE, handle=library._handle).kvtier_plan
    except AttributeError:  # a build of the helper from before the planner
        log.info("native planning unavailable; plans are made in numpy", error="no kvtier_plan")
        return None
    ids = ctypes.POINTER(ctypes.c_int64)  # takes a c_int64 (by reference) or an array of them
    function.argtypes = [ids, ids, ids, ctypes.c_int64, ids, ctypes.c_int64, ids, ctypes.c_int64]
    function.restype = ctypes.c_int64
    return function


_INT64: Final = np.dtype(np.int64)
# The first element of a C-contiguous, writable array, for a pointer argument.
_FIRST: Final[Callable[[Any], ctypes.c_int64]] = ctypes.c_int64.from_buffer


@dataclass(frozen=True, eq=False)
class _GroupTable:
    """One group's views as arrays, in the group's view order (see `plan_transfer`)."""

    one_run: bool  # every view's page is one run
    min_blocks: int  # the fewest blocks any of its views has
    address: IntArray
    block_stride: IntArray
    page_size: IntArray
    offset: IntArray  # of each view's section in a slot


# Per canonical KV (while it lives), per slot layout: the group tables.
_TABLES: weakref.WeakKeyDictionary[CanonicalKV, dict[SlotLayout, tuple[_GroupTable, ...]]] = (
    weakref.WeakKeyDictionary()
)
_TABLES_LOCK = threading.Lock()


def _group_tables(kv: CanonicalKV, layout: SlotLayout) -> tuple[_GroupTable, ...]:
    by_layout = _TABLES.get(kv)
    tables = None if by_layout is None else by_layout.get(layout)
    if tables is not None:
        return tables
    built = []
    for members in kv.groups:
        views = [kv.views[index] for index in members]
        built.append(
            _GroupTable(
                one_run=all(view.is_contiguous_page for view in views),
                min_blocks=min((view.num_blocks for view in views), default=0),
                address=np.array([view.address for view in views], dtype=np.int64),
                block_stride=np.array([view.block_stride for view in views], dtype=np.int64),
                page_size=np.array([view.page_size for view in views], dtype=np.int64),
                offset=np.array([layout.offsets[index] for index in members], dtype=np.int64),
            )
        )
    tables = tuple(built)
    with _TABLES_LOCK:  # planners run on several threads
        _TABLES.setdefault(kv, {})[layout] = tables
    return tables


def _slots_needed(gpu: GPUSpec, factor: int) -> int:
    return sum(
        -(-(first % factor + count) // factor)
        for count, first in zip(gpu.group_sizes, gpu.block_indices, strict=True)
        if count
    )


def _check_ids(what: str, ids: npt.NDArray[Any], limit: int) -> None:
    # One reduction: as unsigned, a negative id is larger than any limit.
    if len(ids) and int(ids.astype(np.int64, copy=False).view(np.uint64).max()) >= limit:
        bad = ids[(ids < 0) | (ids >= limit)]
        raise ValueError(f"{what} {int(bad[0])} out of range [0, {limit})")
