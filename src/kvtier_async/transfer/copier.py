"""Plan copiers: the one data path that runs a `CopyPlan` between device memory and host slots.

Theory of operation
-------------------
Everything that moves KV bytes between a device and the CPU tier ends here: the transfer
handlers (`kvtier_async.transfer.handlers`, the vLLM worker's path, which plan a copy from
(GPU spec, CPU spec) pairs) and `BlockCopier` (`kvtier_async.transfer.blocks`, the async
API's path, which plans whole caller blocks). A plan is raw (source, destination, size)
triples; the copier that runs it is chosen by where the device memory lives:

`HostPlanCopier` (both sides in CPU memory)
    The batch copy (`kvtier_async.transfer.hostcopy`: native loop or ``ctypes.memmove``),
    GIL released. `run` copies in the calling thread (a worker thread, or inline for a
    small copy); `transfer` runs it in a worker thread with ``anyio.to_thread.run_sync``
    and does not abandon the thread on cancellation: the awaiting task raises the
    cancellation only after the copy stopped. With ``chunk_bytes`` the copy goes in pieces
    of about that many bytes and checks for cancellation between them (a cancelled job stops
    at the next boundary, so its wait is short); without, the plan is one batch.
`CudaPlanCopier` (device memory on a CUDA device, host slots in the shared region)
    Each transfer borrows a stream and a start/end event pair from pools. The stream first
    waits on the compute streams (a store must not read KV the forward pass is still
    writing; a load must not race pending writes to its blocks) and on the previous
    transfer's end event (transfers run in submission order). With ``use_triton`` a batch of
    at least ``MIN_JOBS`` runs shorter than ``triton_below`` bytes on average is one launch
    of the Triton swap-blocks kernel (`kvtier_async.kernels.swap_blocks`), its descriptor
    table written into pooled pinned rows and uploaded on the transfer's stream into one
    device table the copier reuses (transfers run in order on the device, so the next
    upload lands after the last kernel read it): a launch allocates nothing, where a
    pinned table and a device copy per launch cost more than the kernel on small batches
    (``kvtier bench gpu``'s latency rows); otherwise the
    copy engine moves it, one ``cudaMemcpyAsync`` per run (through ctypes on torch's CUDA
    runtime, `kvtier_async._cudart`, after a self-test), else
    ``Tensor.copy_(non_blocking=True)`` on views of the device allocations
    (`DeviceStorages`). Completion is the end event, awaited through the `EventBridge`; a
    cancelled transfer waits for the end event (shielded) before it re-raises, so nothing is
    written after its job ended. A device copy is not split: the DMA of one job takes
    milliseconds, and the wait for it is what a cancellation costs.

Both return a `TransferResult` (bytes moved, seconds the copy took) or raise `TransferError`
for a failed copy. Plans are trusted: their builders bound every address.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, NamedTuple

import anyio
import anyio.from_thread
import anyio.lowlevel
import numpy as np

from kvtier_async._cudart import memcpy_async
from kvtier_async._log import get_logger

from .bridge import EventBridge
from .hostcopy import BatchCopier, batch_copier, copier_name, merges_runs
from .plan import CopyPlan, HostSlots

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_TRITON_THRESHOLD",
    "CudaPlanCopier",
    "DeviceStorages",
    "HostPlanCopier",
    "TransferError",
    "TransferResult",
    "chunked",
    "triton_plan",
]

log = get_logger(__name__)

# Plans with more runs than this are enqueued from a worker thread (each copy-engine run
# costs several microseconds of Python and driver time, which the loop should not pay).
_INLINE_MAX_RUNS: Final = 64
# Values in the smallest Triton descriptor table (3 per job: 341 jobs), made with the copier.
_TABLE_VALUES: Final = 1024


@dataclass(frozen=True, slots=True)
class TransferResult:
    """A finished transfer: ``bytes`` moved, ``seconds`` the copy itself took."""

    bytes: int
    seconds: float


class TransferError(RuntimeError):
    """A copy failed (device error, memory fault reported by the driver)."""


def chunked(plan: CopyPlan, chunk_bytes: int) -> Iterator[CopyPlan]:
    """``plan`` in consecutive pieces of about ``chunk_bytes`` bytes (a run longer than
    that is split; a piece ends where a run crosses a multiple of ``chunk_bytes``)."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    if plan.total_bytes <= chunk_bytes:
        yield plan
        return
    plan = _split_runs(plan, chunk_bytes)
    piece = (np.cumsum(plan.size) - 1) // chunk_bytes
    bounds = [0, *(np.flatnonzero(np.diff(piece)) + 1).tolist(), len(plan)]
    for start, end in itertools.pairwise(bounds):
        yield CopyPlan(plan.src[start:end], plan.dst[start:end], plan.size[start:end])


def _split_runs(plan: CopyPlan, max_bytes: int) -> CopyPlan:
    pieces = -(-plan.size // max_bytes)
    if int(pieces.max()) <= 1:
        return plan
    run = np.repeat(np.arange(len(plan)), pieces)
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)
    offset = (np.arange(len(run)) - first) * max_bytes
    size = np.minimum(plan.size[run] - offset, max_bytes)
    return CopyPlan(plan.src[run] + offset, plan.dst[run] + offset, size)


class HostPlanCopier:
    """Runs plans between CPU buffers (see the module docstring).

    ``copier`` replaces the batch copy (tests use it to slow a copy down).
    """

    def __init__(self, copier: BatchCopier | None = None) -> None:
        self._copier = copier or batch_copier()
        self._merge = not merges_runs(self._copier)

    @property
    def name(self) -> str:
        """``native`` or ``memmove``: the batch copy in use."""
        return copier_name(self._copier)

    def run(self, plan: CopyPlan, *, chunk_bytes: int | None = None) -> TransferResult:
        """Copy ``plan`` in the calling thread. With ``chunk_bytes``, from an anyio worker
        thread only: checks for the host task's cancellation between pieces."""
        started = time.perf_counter()
        if chunk_bytes is None:
            self._copier(plan.merged() if self._merge else plan)
        else:
            for index, piece in enumerate(chunked(plan, chunk_bytes)):
                if index:
                    anyio.from_thread.check_cancelled()
                self._copier(piece.merged() if self._merge else piece)
        return TransferResult(plan.total_bytes, time.perf_counter() - started)

    async def transfer(self, plan: CopyPlan, *, chunk_bytes: int | None = None) -> TransferResult:
        """`run` in a worker thread; a cancelled job raises only once the copy stopped."""
        # Not abandon_on_cancel: a cancelled job waits here until the copy has stopped,
        # then raises the cancellation (on every backend) rather than returning a result.
        result = await anyio.to_thread.run_sync(lambda: self.run(plan, chunk_bytes=chunk_bytes))
        await anyio.lowlevel.checkpoint_if_cancelled()
        return result


class DeviceStorages:
    """The device allocations behind some tensors, as flat uint8 tensors, by address (for
    copies issued as ``Tensor.copy_`` on views rather than by address)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        import torch

        by_base: dict[int, torch.Tensor] = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            base = int(storage.data_ptr())
            if base not in by_base:
                by_base[base] = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(
                    storage, 0, (storage.nbytes(),), (1,)
                )
        self.bases = np.asarray(sorted(by_base), dtype=np.int64)
        self.flats = [by_base[int(base)] for base in self.bases]

    def locate(self, addresses: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], Any]:
        which = np.searchsorted(self.bases, addresses, side="right") - 1
        return which, addresses - self.bases[which]


@dataclass(eq=False)
class _InFlight:
    stream: Any
    start: Any
    end: Any
    num_bytes: int
    keepalive: object  # what the device may still read (a `_Staged` descriptor table)


class _Rows(NamedTuple):
    """Pinned int64 staging rows for a descriptor table, and their numpy view."""

    tensor: Any
    values: Any


@dataclass(frozen=True, slots=True)
class _Staged:
    """A Triton launch's descriptor table: the pinned staging rows it was written into
    (back to the copier's pool when the transfer ends) and the device table the kernel
    reads (kept alive until then, in case a larger one replaced it meanwhile)."""

    host: _Rows
    device: Any


#: Mean bytes per merged run below which a plan of at least ``MIN_JOBS`` runs is one Triton
#: launch, where Triton may run (measured: `kvtier_async.transfer.handlers`).
DEFAULT_TRITON_THRESHOLD: Final = 1 << 20


def triton_plan(runs: int, total_bytes: int, below: int | None) -> bool:
    """Whether a plan of ``runs`` merged runs moving ``total_bytes`` is one Triton launch
    (where Triton may run): at least ``MIN_JOBS`` runs (fewer do not amortise the launch)
    shorter than ``below`` bytes on average (None: any length)."""
    from kvtier_async.kernels.swap_blocks import MIN_JOBS

    if runs < MIN_JOBS:
        return False
    return below is None or total_bytes < below * runs


class CudaPlanCopier:
    """Runs plans between one CUDA device and pinned host slots on pooled side streams.

    Args:
        device: The CUDA device the plans' device addresses are on.
        host: The host slots (their flat view serves ``Tensor.copy_`` copies).
        to_host: The direction of every plan (device -> host for stores).
        bridge: Wakes awaiting jobs when a transfer's end event completes.
        compute_stream: The stream every transfer waits on by default; default: the current
            stream of the constructing thread (vLLM builds the worker in its model-runner
            thread).
        use_triton: Let the Triton kernel run plans of at least ``MIN_JOBS`` runs (the
            caller checked that the host slots are pinned; each plan's addresses and sizes
            are checked here for the kernel's 8-byte words).
        triton_below: With ``use_triton``, the mean bytes per run below which a plan is
            one Triton launch (scattered small runs); a plan of longer runs goes to the
            copy engine. None: every plan of at least ``MIN_JOBS`` runs is a launch.
        use_cudart: Issue copy-engine runs with ``cudaMemcpyAsync`` through ctypes (when
            its self-test passes) rather than ``Tensor.copy_`` (several us per run more).
        storages: The device allocations, for ``Tensor.copy_`` copies; may instead be given
            per transfer.
        plans_aligned: The caller vouches that every plan's addresses and sizes are
            multiples of 8 (a handler checked its layout once), so `triton_for` skips the
            check per plan.
    """

    def __init__(
        self,
        device: torch.device,
        host: HostSlots,
        *,
        to_host: bool,
        bridge: EventBridge,
        compute_stream: torch.cuda.Stream | None = None,
        use_triton: bool = False,
        triton_below: int | None = None,
        use_cudart: bool = True,
        storages: DeviceStorages | None = None,
        plans_aligned: bool = False,
    ) -> None:
        import torch

        if triton_below is not None and triton_below < 1:
            raise ValueError(f"triton_below must be a positive byte count, got {triton_below}")

        if device.type != "cuda":
            raise ValueError(f"CudaPlanCopier needs a CUDA device, got {device}")
        self._device = device
        self._host: HostSlots | None = host
        self._to_host = to_host
        self._bridge = bridge
        self._compute = compute_stream or torch.cuda.current_stream(device)
        self._host_flat: torch.Tensor | None = host.flat()
        self._storages = storages
        self._use_triton = use_triton
        self._triton_below = triton_below
        self._memcpy = memcpy_async() if use_cudart else None
        self._streams: list[torch.cuda.Stream] = []
        self._events: list[torch.cuda.Event] = []
        self._last_end: torch.cuda.Event | None = None
        self._plans_aligned = plans_aligned
        # Recorded on a stream that a transfer's stream then waits on (one wait each, under
        # the lock: a wait holds the record it saw, so the next record cannot disturb it).
        self._marker = torch.cuda.Event()  # type: ignore[no-untyped-call]
        # Triton descriptor tables: free pinned staging rows, and the one device table every
        # launch reads (transfers run in order on the device, so one suffices; it grows).
        self._staging: list[_Rows] = [_new_staging(1)] if use_triton else []
        self._device_table: torch.Tensor | None = (
            torch.empty(_TABLE_VALUES, dtype=torch.int64, device=device) if use_triton else None
        )
        self._lock = threading.Lock()

    @property
    def uses_triton(self) -> bool:
        """Whether the Triton kernel may run this copier's plans (`triton_for` decides)."""
        return self._use_triton

    def triton_for(self, plan: CopyPlan, total_bytes: int | None = None) -> bool:
        """Whether ``plan`` is one Triton launch: Triton allowed, at least ``MIN_JOBS``
        runs shorter than ``triton_below`` bytes on average, every address and size a
        multiple of 8 (the kernel copies words; checked unless ``plans_aligned``).
        ``total_bytes``: the plan's, when the caller has it."""
        if not self._use_triton:
            return False
        total = plan.total_bytes if total_bytes is None else total_bytes
        if not triton_plan(len(plan), total, self._triton_below):
            return False
        return self._plans_aligned or not bool(((plan.src | plan.dst | plan.size) & 7).any())

    @property
    def copy_engine_path(self) -> str:
        """How copy-engine runs are issued: ``cudaMemcpyAsync`` or ``torch copy_``."""
        return "cudaMemcpyAsync" if self._memcpy is not None else "torch copy_"

    def busy(self) -> bool:
        """Whether the last transfer enqueued has not completed on the device yet."""
        last = self._last_end
        return last is not None and not last.query()  # type: ignore[no-untyped-call]

    async def transfer(
        self,
        plan: CopyPlan,
        *,
        after: Sequence[torch.cuda.Stream] = (),
        storages: DeviceStorages | None = None,
    ) -> TransferResult:
        """Enqueue ``plan`` (after the compute stream and the streams ``after``) and await
        its completion; a cancelled transfer returns only after its copy ended."""
        total = plan.total_bytes
        triton = self.triton_for(plan, total)
        if triton or len(plan) <= _INLINE_MAX_RUNS:  # one launch, or a few runs: inline
            flight = self._submit(plan, after, storages, triton, total)
        else:
            with anyio.CancelScope(shield=True):  # what is enqueued must be awaited below
                flight = await anyio.to_thread.run_sync(
                    self._submit, plan, after, storages, triton, total
                )
        try:
            await self._bridge.wait(flight.end)
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(flight.end.synchronize)
            self._recycle(flight)
            raise
        except Exception as exc:
            raise TransferError(f"transfer failed on {self._device}: {exc}") from exc
        return self._finish(flight)

    def execute(
        self,
        plan: CopyPlan,
        *,
        after: Sequence[torch.cuda.Stream] = (),
        storages: DeviceStorages | None = None,
    ) -> TransferResult:
        """`transfer`, blocking the calling (worker) thread."""
        total = plan.total_bytes
        flight = self._submit(plan, after, storages, self.triton_for(plan, total), total)
        try:
            flight.end.synchronize()
        except Exception as exc:
            raise TransferError(f"transfer failed on {self._device}: {exc}") from exc
        return self._finish(flight)

    def close(self) -> None:
        """Wait for the last transfer, then release streams, events and host memory."""
        with self._lock:
            if self._last_end is not None:
                self._last_end.synchronize()
            self._last_end = None
            self._streams.clear()
            self._events.clear()
            self._staging.clear()
            self._device_table = None
            self._host_flat = None
            self._host = None

    # -- internals --------------------------------------------------------------------

    def _submit(
        self,
        plan: CopyPlan,
        after: Sequence[torch.cuda.Stream],
        storages: DeviceStorages | None,
        triton: bool,
        total_bytes: int,
    ) -> _InFlight:
        """Enqueue ``plan`` on a pooled stream: one Triton launch if ``triton`` (decided by
        `triton_for`), else the copy engine."""
        with self._lock:
            stream = self._streams.pop() if self._streams else _new_stream(self._device)
            start = self._events.pop() if self._events else _new_event()
            end = self._events.pop() if self._events else _new_event()
            # ``stream.wait_stream(other)``, without a new event each time
            marker = self._marker
            marker.record(self._compute)
            stream.wait_event(marker)
            for other in after:
                if other != self._compute:
                    marker.record(other)
                    stream.wait_event(marker)
            if self._last_end is not None:
                stream.wait_event(self._last_end)
            start.record(stream)
            try:
                keepalive = self._enqueue(plan, stream, storages or self._storages, triton)
            except Exception as exc:
                end.record(stream)
                self._last_end = end
                end.synchronize()  # nothing enqueued may outlive the failed job
                raise TransferError(f"could not enqueue a transfer: {exc}") from exc
            end.record(stream)
            self._last_end = end
        return _InFlight(stream, start, end, total_bytes, keepalive)

    def _enqueue(
        self,
        plan: CopyPlan,
        stream: torch.cuda.Stream,
        storages: DeviceStorages | None,
        triton: bool,
    ) -> object:
        import torch

        if triton:
            with torch.cuda.device(self._device), torch.cuda.stream(stream):
                return self._launch_triton(plan, stream)
        if self._memcpy is not None:
            # An explicit stream: no current-stream switch. The device is set all the same:
            # a thread's current device starts at 0, and a runtime call there would make a
            # context on a GPU this process may not own (vLLM's worker for GPU 1, say).
            memcpy, handle = self._memcpy, int(stream.cuda_stream)
            runs = zip(plan.dst.tolist(), plan.src.tolist(), plan.size.tolist(), strict=True)
            with torch.cuda.device(self._device):
                for dst, src, nbytes in runs:
                    memcpy(dst, src, nbytes, handle)
        else:
            with torch.cuda.device(self._device), torch.cuda.stream(stream):
                self._torch_copies(plan, storages)
        return None

    def _launch_triton(self, plan: CopyPlan, stream: torch.cuda.Stream) -> _Staged:
        """Write the plan's descriptor table into pinned staging rows, upload it on
        ``stream`` into the device table, launch the kernel after it (on the current
        stream, ``stream``). The caller holds the lock."""
        from kvtier_async.kernels.swap_blocks import launch_device_table

        jobs = len(plan)
        rows = self._take_staging(3 * jobs)
        rows.values[:jobs] = plan.src
        rows.values[jobs : 2 * jobs] = plan.dst
        rows.values[2 * jobs : 3 * jobs] = plan.size
        table = self._table_for(3 * jobs)
        if self._memcpy is not None:
            self._memcpy(
                int(table.data_ptr()),
                int(rows.tensor.data_ptr()),
                24 * jobs,
                int(stream.cuda_stream),
            )
        else:
            table[: 3 * jobs].copy_(rows.tensor[: 3 * jobs], non_blocking=True)
        launch_device_table(table, jobs, max_size=plan.max_size)
        return _Staged(rows, table)

    def _take_staging(self, count: int) -> _Rows:
        """The smallest free pinned int64 staging rows for at least ``count`` values; a new
        allocation (a power of two of at least `_TABLE_VALUES`) when none fits. The pool
        grows to the most transfers in flight at once. A pinned allocation may wait for
        the device, so the first rows are made with the copier."""
        pool = self._staging
        fits = [index for index, rows in enumerate(pool) if len(rows.values) >= count]
        if not fits:
            return _new_staging(count)
        return pool.pop(min(fits, key=lambda index: len(pool[index].values)))

    def _table_for(self, count: int) -> torch.Tensor:
        """The device table, grown to at least ``count`` values. A table it replaces stays
        alive while a transfer in flight holds it (its `_Staged`)."""
        import torch

        table = self._device_table
        if table is None or table.numel() < count:
            table = torch.empty(_table_size(count), dtype=torch.int64, device=self._device)
            self._device_table = table
        return table

    def _torch_copies(self, plan: CopyPlan, storages: DeviceStorages | None) -> None:
        host_flat, host = self._host_flat, self._host
        if host_flat is None or host is None:
            raise RuntimeError("CudaPlanCopier is closed")
        if storages is None:
            raise RuntimeError("torch copies need the device storages of the plan")
        dev_addr, host_addr = (plan.src, plan.dst) if self._to_host else (plan.dst, plan.src)
        which, dev_off = storages.locate(dev_addr)
        host_off = (host_addr - host.address).tolist()
        flats = storages.flats
        runs = zip(which.tolist(), dev_off.tolist(), host_off, plan.size.tolist(), strict=True)
        for index, d, h, n in runs:
            device_bytes = flats[index][d : d + n]
            host_bytes = host_flat[h : h + n]
            if self._to_host:
                host_bytes.copy_(device_bytes, non_blocking=True)
            else:
                device_bytes.copy_(host_bytes, non_blocking=True)

    def _finish(self, flight: _InFlight) -> TransferResult:
        seconds = flight.start.elapsed_time(flight.end) / 1e3
        self._recycle(flight)
        return TransferResult(flight.num_bytes, seconds)

    def _recycle(self, flight: _InFlight) -> None:
        """Back to the pools: the stream, the events and the staging rows of a transfer
        that has ended on the device (its upload read them long before)."""
        with self._lock:
            self._streams.append(flight.stream)
            self._events.extend((flight.start, flight.end))
            if isinstance(flight.keepalive, _Staged) and self._host is not None:
                self._staging.append(flight.keepalive.host)


def _table_size(count: int) -> int:
    """Values in a descriptor table for ``count``: a power of two, at least `_TABLE_VALUES`."""
    return max(_TABLE_VALUES, 1 << (count - 1).bit_length())


def _new_staging(count: int) -> _Rows:
    """Pinned int64 staging rows for at least ``count`` values."""
    import torch

    tensor = torch.empty(_table_size(count), dtype=torch.int64, pin_memory=True)
    return _Rows(tensor, tensor.numpy())


def _new_stream(device: torch.device) -> torch.cuda.Stream:
    import torch

    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]


def _new_event() -> torch.cuda.Event:
    import torch

    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
