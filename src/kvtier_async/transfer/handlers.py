"""Transfer handlers: move the blocks of one (src spec, dst spec) pair as one job.

Theory of operation
-------------------
The worker side of the offload. `TransferRouter` holds one handler per (source medium,
destination medium), as vLLM's ``OffloadingWorker`` does, and picks it from the specs'
``medium``: ``(GPU, CPU)`` stores device blocks into CPU slots, ``(CPU, GPU)`` loads them
back. The "GPU" side is whatever device the canonical KV views live on: CUDA memory in
production, CPU tensors where there is no GPU (tests, CPU-only runs). The handler kind is
chosen once, at construction, from that device:

Handlers plan; the copy itself is run by a plan copier (`kvtier_async.transfer.copier`), the
same code that moves the async API's blocks (`kvtier_async.transfer.blocks`):

`HostCopyHandler` (device caches in CPU memory)
    Plans the copy (`Planner`: merged runs, in C where it can) and runs it with a `HostPlanCopier`
    (the batch copy, which joins contiguous runs, GIL released). A copy of up to ``inline_bytes``
    (256 KiB by default: tens of microseconds) runs right in the loop: handing it to a worker thread
    and back costs two thread wake-ups, measured at about 0.3 ms of CPU per job on a 2-core VM, more
    than the copy, and in a process that also runs vLLM's scheduler that CPU is taken from it. A
    larger one runs in a worker thread with ``anyio.to_thread.run_sync``, so the loop stays free.
    Cancelling the job does not abandon the thread: the awaiting task returns (raising the
    cancellation) only after the copy has finished, so no copy ever writes after its job reported
    done.
`CudaCopyHandler`
    Runs its plans with a `CudaPlanCopier`: pooled side streams that wait on the compute
    stream and on the previous transfer, completion through the `EventBridge`, a cancelled
    job waiting (shielded) for its end event before it re-raises. The copy path is chosen
    per transfer, from its plan: when the host slots are pinned, every address is 8-byte
    aligned and Triton is importable, a plan of at least ``MIN_JOBS`` merged runs whose
    mean length is below ``triton_threshold`` (1 MiB by default) is one launch of the
    Triton swap-blocks kernel (`kvtier_async.kernels.swap_blocks`); otherwise the copy
    engine moves it, one ``cudaMemcpyAsync`` per merged run (through ctypes on torch's
    CUDA runtime, after a self-test; else ``Tensor.copy_(non_blocking=True)`` on views).
    So scattered blocks go to Triton and blocks that merge into long runs (contiguous ids)
    to the copy engine, whatever the page size. The threshold is measured: on an H200
    (``kvtier bench gpu``, 2026-12-04, four runs) Triton moved scattered pages of 8 KiB
    to 256 KiB at 1.15-22x the copy engine's rate, tied with it at 512 KiB (0.97-1.12x)
    and lost from 1 MiB (0.80-1.01x), both ways; a merged run of 64 MiB ran at 0.84-0.95
    of one ``Tensor.copy_`` on the copy engine, 0.96 once the copier stopped switching
    torch's current stream and making an event per wait (later runs). (vLLM 0.33 switches
    by page size at 28 KiB, tuned on an H100.)

Every handler offers ``await transfer(src, dst)`` and a synchronous ``execute(src, dst)``
for worker threads (the sync vLLM face). Both return a `TransferResult` (bytes moved,
seconds the copy took) or raise: `ValueError` for specs that do not fit the caches,
`TransferError` for a failed copy.

*Timing of stores.* vLLM submits a step's GPU -> CPU stores at the start of the *next*
step, after the sampled tokens have been sent, so that offloading never delays token
generation. That deferral is the caller's business (the engine/connector); a handler
starts a transfer when asked.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, Final

import anyio
import anyio.lowlevel

from kvtier_async._log import get_logger
from kvtier_async.ledger import CPUSpec, GPUSpec, Medium

from .bridge import BridgeStrategy, EventBridge
from .canonical import CanonicalKV, SlotLayout
from .copier import (
    DEFAULT_TRITON_THRESHOLD,
    CudaPlanCopier,
    DeviceStorages,
    HostPlanCopier,
    TransferError,
    TransferResult,
)
from .hostcopy import BatchCopier
from .plan import CopyPlan, HostSlots, Planner

if TYPE_CHECKING:
    import torch

    from kvtier_async.memory import SharedRegion

__all__ = [
    "CudaCopyHandler",
    "HostCopyHandler",
    "TransferError",
    "TransferHandler",
    "TransferResult",
    "TransferRouter",
]

log = get_logger(__name__)

DEFAULT_INLINE_BYTES: Final = 256 * 1024

Spec = GPUSpec | CPUSpec


class TransferHandler(ABC):
    """Moves blocks in one direction between the device KV caches and the host slots."""

    def __init__(
        self,
        kv: CanonicalKV,
        host: HostSlots,
        *,
        block_size_factor: int = 1,
        to_host: bool,
    ) -> None:
        self._kv = kv
        self._host: HostSlots | None = host
        self._layout = kv.slot_layout(block_size_factor)
        self._to_host = to_host
        if host.slot_bytes < self._layout.slot_bytes:
            raise ValueError(
                f"host slots hold {host.slot_bytes} bytes, a block of factor "
                f"{block_size_factor} needs {self._layout.slot_bytes}"
            )
        self._planner: Planner | None = Planner(kv, self._layout, host, to_host=to_host)

    @property
    def src_medium(self) -> Medium:
        return Medium.GPU if self._to_host else Medium.CPU

    @property
    def dst_medium(self) -> Medium:
        return Medium.CPU if self._to_host else Medium.GPU

    @property
    def slot_layout(self) -> SlotLayout:
        return self._layout

    @property
    def planner_path(self) -> str:
        """``native`` (plans made in C) or ``numpy`` (see `Planner`)."""
        planner = self._planner
        return "native" if planner is not None and planner.native else "numpy"

    def plan(self, src: Spec, dst: Spec) -> CopyPlan:
        """The merged byte copies of ``src -> dst`` (validates the specs)."""
        planner = self._planner
        if planner is None:
            raise RuntimeError(f"{type(self).__name__} is closed")
        gpu, cpu = (src, dst) if self._to_host else (dst, src)
        if not isinstance(gpu, GPUSpec) or not isinstance(cpu, CPUSpec):
            raise ValueError(
                f"{type(self).__name__} moves {self.src_medium.value} -> "
                f"{self.dst_medium.value}, got {type(src).__name__} -> {type(dst).__name__}"
            )
        return planner(gpu, cpu)

    @abstractmethod
    async def transfer(self, src: Spec, dst: Spec) -> TransferResult:
        """Move ``src`` to ``dst``; returns when the copy is complete."""

    @abstractmethod
    def execute(self, src: Spec, dst: Spec) -> TransferResult:
        """`transfer`, blocking the calling (worker) thread."""

    def close(self) -> None:
        """Release the host memory (so its region can be closed)."""
        self._host = None
        self._planner = None

    def _live_host(self) -> HostSlots:
        if self._host is None:
            raise RuntimeError(f"{type(self).__name__} is closed")
        return self._host


class HostCopyHandler(TransferHandler):
    """Copies between device caches that live in CPU memory and the host slots.

    ``copier`` replaces the batch copy (tests use it to slow a copy down).
    ``inline_bytes``: `transfer` copies up to this many bytes in the calling (loop) thread,
    more in a worker thread (0: always in a worker thread).
    """

    def __init__(
        self,
        kv: CanonicalKV,
        host: HostSlots,
        *,
        block_size_factor: int = 1,
        to_host: bool,
        copier: BatchCopier | None = None,
        inline_bytes: int = DEFAULT_INLINE_BYTES,
    ) -> None:
        if kv.device.type != "cpu":
            raise ValueError(f"HostCopyHandler needs CPU tensors, the KV caches are on {kv.device}")
        if inline_bytes < 0:
            raise ValueError(f"inline_bytes must be >= 0, got {inline_bytes}")
        super().__init__(kv, host, block_size_factor=block_size_factor, to_host=to_host)
        self._copier = HostPlanCopier(copier)
        self._inline_bytes = inline_bytes

    @property
    def copier_name(self) -> str:
        return self._copier.name

    async def transfer(self, src: Spec, dst: Spec) -> TransferResult:
        plan = self.plan(src, dst)
        if plan.total_bytes <= self._inline_bytes:  # shorter than a thread hand-off
            result = self._copier.run(plan)
        else:
            # Not abandon_on_cancel: a cancelled job waits here until the copy has
            # finished, then raises the cancellation (on every backend).
            result = await anyio.to_thread.run_sync(self._copier.run, plan)
        await anyio.lowlevel.checkpoint_if_cancelled()
        return result

    def execute(self, src: Spec, dst: Spec) -> TransferResult:
        return self._copier.run(self.plan(src, dst))


class CudaCopyHandler(TransferHandler):
    """Copies between CUDA KV caches and pinned host slots on pooled side streams.

    Args:
        bridge: Wakes awaiting jobs when a transfer's end event completes.
        compute_stream: The stream the model writes KV on; default: the current stream of
            the constructing thread (vLLM builds the worker in its model-runner thread).
        use_triton: Force the Triton kernel on (every plan of at least ``MIN_JOBS`` runs,
            whatever their length) or off; default: allowed when the host slots are
            pinned, Triton is importable and every address is 8-byte aligned, and then
            used for the plans whose mean run is shorter than ``triton_threshold``.
        triton_threshold: Mean bytes per merged run from which the copy engine is used.
        use_cudart: Issue copy-engine runs with ``cudaMemcpyAsync`` through ctypes (when
            its self-test passes) rather than ``Tensor.copy_`` (several us per run more).
    """

    def __init__(
        self,
        kv: CanonicalKV,
        host: HostSlots,
        *,
        block_size_factor: int = 1,
        to_host: bool,
        bridge: EventBridge,
        compute_stream: torch.cuda.Stream | None = None,
        use_triton: bool | None = None,
        triton_threshold: int = DEFAULT_TRITON_THRESHOLD,
        use_cudart: bool = True,
    ) -> None:
        if kv.device.type != "cuda":
            raise ValueError(
                f"CudaCopyHandler needs CUDA tensors, the KV caches are on {kv.device}"
            )
        super().__init__(kv, host, block_size_factor=block_size_factor, to_host=to_host)
        self._device = kv.device
        triton = self._choose_triton(use_triton)
        self._copier = CudaPlanCopier(
            kv.device,
            host,
            to_host=to_host,
            bridge=bridge,
            compute_stream=compute_stream,
            use_triton=triton,
            triton_below=None if use_triton else triton_threshold,
            use_cudart=use_cudart,
            storages=DeviceStorages([view.tensor for view in kv.views]),
            plans_aligned=triton,  # Triton is allowed only where the layout is aligned
        )
        log.debug(
            "cuda copy handler ready",
            direction="D2H" if to_host else "H2D",
            device=str(self._device),
            triton=self._copier.uses_triton,
            copy_engine=self._copier.copy_engine_path,
            pinned=host.pinned,
        )

    @property
    def copier(self) -> CudaPlanCopier:
        return self._copier

    @property
    def uses_triton(self) -> bool:
        """Whether the Triton kernel may run this handler's transfers (`path_for` says
        which path one takes)."""
        return self._copier.uses_triton

    def path_for(self, src: Spec, dst: Spec) -> str:
        """The path the transfer ``src -> dst`` takes: ``triton`` or `copy_engine_path`."""
        return "triton" if self._copier.triton_for(self.plan(src, dst)) else self.copy_engine_path

    @property
    def copy_engine_path(self) -> str:
        """How copy-engine runs are issued: ``cudaMemcpyAsync`` or ``torch copy_``."""
        return self._copier.copy_engine_path

    async def transfer(self, src: Spec, dst: Spec) -> TransferResult:
        return await self._copier.transfer(self.plan(src, dst))

    def execute(self, src: Spec, dst: Spec) -> TransferResult:
        return self._copier.execute(self.plan(src, dst))

    def close(self) -> None:
        """Wait for the last transfer, then release streams, events and host memory."""
        self._copier.close()
        super().close()

    def _choose_triton(self, use_triton: bool | None) -> bool:
        from kvtier_async.kernels.swap_blocks import triton_available

        host = self._live_host()
        aligned = _all_aligned(self._kv, self._layout, host)
        if use_triton is None:
            return host.pinned and triton_available() and aligned
        if use_triton and not (host.pinned and triton_available() and aligned):
            raise ValueError(
                "the Triton path needs pinned host slots, Triton, and 8-byte aligned pages "
                f"(pinned={host.pinned}, triton={triton_available()}, aligned={aligned})"
            )
        return use_triton


def _all_aligned(kv: CanonicalKV, layout: SlotLayout, host: HostSlots) -> bool:
    values = [host.address, host.stride, *layout.offsets, *layout.page_sizes]
    for view in kv.views:
        values += [view.address, view.block_stride, *view.run_offsets.tolist()]
        values += view.run_sizes.tolist()
    return all(value % 8 == 0 for value in values)


class TransferRouter:
    """Routes a (src spec, dst spec) pair to the handler for its media.

    Build it with `TransferRouter.create` from the canonical KV caches and the CPU tier's
    memory; it owns the handlers (and the event bridge it made) and closes them.
    """

    def __init__(
        self, handlers: Iterable[TransferHandler], *, bridge: EventBridge | None = None
    ) -> None:
        self._handlers: dict[tuple[Medium, Medium], TransferHandler] = {}
        for handler in handlers:
            key = (handler.src_medium, handler.dst_medium)
            if key in self._handlers:
                raise ValueError(f"two handlers for {key[0].value} -> {key[1].value}")
            self._handlers[key] = handler
        self._bridge = bridge

    @classmethod
    def create(
        cls,
        kv: CanonicalKV,
        host: HostSlots | SharedRegion,
        *,
        block_size_factor: int = 1,
        bridge_strategy: BridgeStrategy | str = BridgeStrategy.THREAD,
        compute_stream: torch.cuda.Stream | None = None,
        use_triton: bool | None = None,
    ) -> TransferRouter:
        """Store and load handlers for ``kv``'s device: host copies for CPU tensors, CUDA
        copies (with an `EventBridge` of ``bridge_strategy``) for CUDA tensors."""
        slots = host if isinstance(host, HostSlots) else HostSlots.from_region(host)
        device = kv.device
        if device.type == "cpu":
            handlers: list[TransferHandler] = [
                HostCopyHandler(kv, slots, block_size_factor=block_size_factor, to_host=flag)
                for flag in (True, False)
            ]
            return cls(handlers)
        if device.type != "cuda":
            raise ValueError(f"no transfer handlers for KV caches on {device}")
        bridge = EventBridge(bridge_strategy, name=str(device))
        handlers = [
            CudaCopyHandler(
                kv,
                slots,
                block_size_factor=block_size_factor,
                to_host=flag,
                bridge=bridge,
                compute_stream=compute_stream,
                use_triton=use_triton,
            )
            for flag in (True, False)
        ]
        return cls(handlers, bridge=bridge)

    def handler_for(self, src: Spec, dst: Spec) -> TransferHandler:
        key = (src.medium, dst.medium)
        try:
            return self._handlers[key]
        except KeyError:
            raise ValueError(f"no handler for {key[0].value} -> {key[1].value}") from None

    async def transfer(self, src: Spec, dst: Spec) -> TransferResult:
        """Move ``src`` to ``dst`` as one job (see `TransferHandler.transfer`)."""
        return await self.handler_for(src, dst).transfer(src, dst)

    def execute(self, src: Spec, dst: Spec) -> TransferResult:
        """`transfer` from a worker thread, blocking it."""
        return self.handler_for(src, dst).execute(src, dst)

    @property
    def handlers(self) -> dict[tuple[Medium, Medium], TransferHandler]:
        return dict(self._handlers)

    def close(self) -> None:
        """Close every handler (waiting for in-flight device copies) and the bridge."""
        for handler in self._handlers.values():
            handler.close()
        if self._bridge is not None:
            self._bridge.close()
