"""Whole-block copies between a caller's buffers and the CPU tier's slots (the async API's path).

`TieredKVCache.store` / `load` take each block as whatever the caller holds: a numpy array, a
buffer or a CPU tensor (all viewed as flat host bytes), or a CUDA tensor (a `DeviceBlock`,
which also remembers the stream the caller was on). `BlockCopier.copy` plans one run per
block, ``block_bytes`` between the block's address and its slot, and runs the plan with the
plan copiers of `kvtier_async.transfer.copier`, the code the vLLM worker's transfer handlers
run:

- host blocks with a `HostPlanCopier`: a small copy (up to ``inline_bytes``, a few
  microseconds of memcpy) inline in the calling thread, since a thread hop would cost more;
  a larger one in a worker thread, in pieces of ``chunk_bytes`` that check for
  cancellation, so a cancelled call waits for one piece at most;
- CUDA blocks with one `CudaPlanCopier` per device and direction, made on first use with
  the copier's `EventBridge`: a side stream that first waits on the device's default stream
  and on the streams the callers were on, completion awaited through the bridge, a
  cancelled copy waited for (shielded) until its end event completed. The host slots are
  pinned when the region was registered with CUDA (`SharedRegion.register_cuda`, which the
  cache does at open when CUDA is present); then a copy of at least ``MIN_JOBS`` blocks
  shorter than `DEFAULT_TRITON_THRESHOLD` on average, every address 8-byte aligned, is one
  launch of the Triton swap-blocks kernel (separate blocks are separate runs: on an H200
  Triton moves scattered 8 KiB-512 KiB runs at 1.0-22x the copy engine's rate), any
  other on the copy engine.

Either way `copy` returns, or raises, only once nothing of the copy can touch the caller's
blocks any more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

from .bridge import BridgeStrategy, EventBridge
from .copier import DEFAULT_TRITON_THRESHOLD, CudaPlanCopier, DeviceStorages, HostPlanCopier
from .plan import CopyPlan, HostSlots

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_CHUNK_BYTES", "DEFAULT_INLINE_BYTES", "BlockCopier", "DeviceBlock"]

DEFAULT_CHUNK_BYTES: Final = 4 << 20  # a threaded copy checks for cancellation this often
DEFAULT_INLINE_BYTES: Final = 256 << 10  # host copies up to this size run in the caller

HostBlock = npt.NDArray[np.uint8]


@dataclass(frozen=True, eq=False)
class DeviceBlock:
    """A flat ``uint8`` CUDA tensor of one block, and the stream its writer was on."""

    tensor: torch.Tensor
    stream: torch.cuda.Stream

    @classmethod
    def of(cls, tensor: torch.Tensor) -> DeviceBlock:
        """``tensor`` with the calling thread's current stream on its device."""
        import torch

        return cls(tensor, torch.cuda.current_stream(tensor.device))


class BlockCopier:
    """Copies whole blocks to and from host slots (see the module docstring).

    ``host`` is the `HostPlanCopier` of host blocks and ``inline_bytes`` the largest host
    copy done in the calling thread; both may be replaced (tests slow the copy down).
    """

    def __init__(
        self,
        slots: HostSlots,
        block_bytes: int,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        inline_bytes: int = DEFAULT_INLINE_BYTES,
        bridge_strategy: BridgeStrategy | str = BridgeStrategy.THREAD,
    ) -> None:
        if not 0 < block_bytes <= slots.slot_bytes:
            raise ValueError(
                f"blocks of {block_bytes} bytes do not fit {slots.slot_bytes}-byte slots"
            )
        self._slots: HostSlots | None = slots
        self._block_bytes = block_bytes
        self._chunk_bytes = chunk_bytes
        self._bridge_strategy = BridgeStrategy(bridge_strategy)
        self._bridges: dict[Any, EventBridge] = {}
        self._cuda: dict[tuple[Any, bool], CudaPlanCopier] = {}
        self.host = HostPlanCopier()
        self.inline_bytes = inline_bytes

    async def copy(
        self, slot_ids: Sequence[int], blocks: Sequence[HostBlock | DeviceBlock], *, to_host: bool
    ) -> int:
        """Copy ``blocks[i]`` into slot ``slot_ids[i]`` (``to_host``) or back; the bytes
        moved. Host blocks are copied first, then each device's blocks."""
        if len(slot_ids) != len(blocks):
            raise ValueError(f"{len(slot_ids)} slots for {len(blocks)} blocks")
        on_host = [i for i, block in enumerate(blocks) if not isinstance(block, DeviceBlock)]
        moved = 0
        if on_host:
            moved += await self._copy_host(slot_ids, blocks, on_host, to_host)
        devices: dict[Any, list[int]] = {}
        for i, block in enumerate(blocks):
            if isinstance(block, DeviceBlock):
                devices.setdefault(block.tensor.device, []).append(i)
        for device, indices in devices.items():
            moved += await self._copy_device(device, slot_ids, blocks, indices, to_host)
        return moved

    def close(self) -> None:
        """Wait for the device copies in flight, then release the host slots (so their
        region can close) and the bridge. Blocking: call it from a worker thread."""
        copiers, self._cuda = list(self._cuda.values()), {}
        for copier in copiers:
            copier.close()
        bridges, self._bridges = list(self._bridges.values()), {}
        for bridge in bridges:
            bridge.close()
        self._slots = None

    # -- internals --------------------------------------------------------------------

    async def _copy_host(
        self,
        slot_ids: Sequence[int],
        blocks: Sequence[Any],
        indices: list[int],
        to_host: bool,
    ) -> int:
        addresses = [blocks[i].__array_interface__["data"][0] for i in indices]
        plan = self._plan([slot_ids[i] for i in indices], addresses, to_host)
        if plan.total_bytes <= self.inline_bytes:
            return self.host.run(plan).bytes
        return (await self.host.transfer(plan, chunk_bytes=self._chunk_bytes)).bytes

    async def _copy_device(
        self,
        device: Any,
        slot_ids: Sequence[int],
        blocks: Sequence[Any],
        indices: list[int],
        to_host: bool,
    ) -> int:
        tensors = [blocks[i].tensor for i in indices]
        streams = list(
            {int(s.cuda_stream): s for s in (blocks[i].stream for i in indices)}.values()
        )
        addresses = [int(tensor.data_ptr()) for tensor in tensors]
        plan = self._plan([slot_ids[i] for i in indices], addresses, to_host)
        copier = self._device_copier(device, to_host)
        by_address = copier.copy_engine_path == "cudaMemcpyAsync"
        storages = None if by_address else DeviceStorages(tensors)  # for Tensor.copy_
        result = await copier.transfer(plan, after=streams, storages=storages)
        return result.bytes

    def _plan(self, slot_ids: Sequence[int], addresses: list[int], to_host: bool) -> CopyPlan:
        slots = self._live_slots()
        ids = np.asarray(slot_ids, dtype=np.int64)
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= slots.num_slots):
            raise ValueError(f"slot ids must be in [0, {slots.num_slots}), got {slot_ids}")
        slot_addresses = slots.address + ids * slots.stride
        block_addresses = np.asarray(addresses, dtype=np.int64)
        sizes = np.full(len(ids), self._block_bytes, dtype=np.int64)
        if to_host:
            return CopyPlan(block_addresses, slot_addresses, sizes)
        return CopyPlan(slot_addresses, block_addresses, sizes)

    def _device_copier(self, device: Any, to_host: bool) -> CudaPlanCopier:
        copier = self._cuda.get((device, to_host))
        if copier is None:
            bridge = self._bridges.get(device)
            if bridge is None:
                bridge = EventBridge(self._bridge_strategy, name=str(device))
                self._bridges[device] = bridge
            import torch

            from kvtier_async.kernels.swap_blocks import triton_available

            slots = self._live_slots()
            copier = CudaPlanCopier(
                device,
                slots,
                to_host=to_host,
                bridge=bridge,
                # the device's default stream, not whatever stream is current on first use;
                # each copy also waits on the streams its callers were on
                compute_stream=torch.cuda.default_stream(device),
                # scattered small blocks in one Triton launch (pinned slots; each plan's
                # addresses are checked for alignment), long runs on the copy engine
                use_triton=slots.pinned and triton_available(),
                triton_below=DEFAULT_TRITON_THRESHOLD,
            )
            self._cuda[(device, to_host)] = copier
        return copier

    def _live_slots(self) -> HostSlots:
        if self._slots is None:
            raise RuntimeError("BlockCopier is closed")
        return self._slots
