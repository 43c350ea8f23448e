"""`TieredKVCache`: the single-process async API for async serving frameworks.

    config = {"block_bytes": 65536, "cpu_bytes_to_use": 1 << 30,
              "secondary_tiers": [{"type": "fs", "root_dir": "/data/kv"}]}
    async with TieredKVCache(config) as cache:
        n = await cache.lookup(keys)            # leading keys available (promotions awaited)
        await cache.load(keys[:n], dst_blocks)  # CPU -> device
        await cache.store(keys[n:], src_blocks) # device -> CPU, then cascaded to every tier

The event loop's thread owns the ledger. The ledger decides, the engine executes, the owner
applies: a lane's worker only queues a job's result (the engine's ``on_result`` is
`TaskRunner.deliver`), and the runner's owner task applies it (`TaskRunner.apply`, the one
place results reach the ledger), or a call that needs its own result applied first (a store,
a load) does it on its way out, in the same order. An error while applying is logged and
stops nothing. A block is any buffer of ``block_bytes`` bytes: a contiguous torch tensor
(CPU here, or CUDA), a numpy array, a bytearray.

Requests. A call without ``req`` is a request of its own: nothing of it outlives the call.
Calls that belong together (a prompt's lookup, load and store) name one request, either with
``async with cache.request(req_id) as r:`` (finished when the block ends) or with ``req=`` on
each call and `request_finished` at the end; the ledger then orders the request's blocks as
vLLM's does (tail blocks are evicted before head blocks) and a lookup's answers stay
consistent across its calls. State kept for a request is released when it finishes.

Events. ``async with cache.events() as stream: async for event in stream:`` receives
`kvtier_async.events` (blocks stored in / removed from each tier). They are recorded only
while somebody listens; a listener that falls more than its buffer behind loses events
(counted in `CacheStats.events_dropped`), the cache never waits for it.

Metrics. `stats` returns the figures (``str(stats)`` is a short summary for a person);
``cache.register_metrics(registry)`` exposes the per-tier series (`kvtier_async.metrics`) to
a ``prometheus_client`` registry you pass. Counters are final once `drain` returned or the
cache closed; `stats` still answers after the close, with the final figures.

Closing is bounded: a clean exit drains for at most ``close_timeout_s``, then cancels what
is left (logging how many jobs, on which lanes), and each tier closes within its own bound.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, cast

import anyio
import anyio.lowlevel
import numpy as np
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from kvtier_async._log import get_logger
from kvtier_async.assembly import assemble
from kvtier_async.engine import Engine, Job, JobError, JobResult, LaneStatistics, TaskRunner
from kvtier_async.events import KVEvent, to_kv_events
from kvtier_async.ledger import (
    DeviceCounters,
    JobKind,
    LedgerStatistics,
    TieringLedger,
)
from kvtier_async.memory import SharedRegion, close_region
from kvtier_async.metrics import (
    CacheCollector,
    Samples,
    TierMetrics,
    samples,
    summary,
    tier_metrics,
)
from kvtier_async.settings import CacheConfig
from kvtier_async.tiers.base import SecondaryTier, TierContext
from kvtier_async.transfer.blocks import BlockCopier, DeviceBlock
from kvtier_async.transfer.plan import HostSlots

__all__ = ["CacheConfig", "CacheRequest", "CacheStats", "StoreResult", "TieredKVCache"]

log = get_logger(__name__)

_LET_GO_S = 30.0  # how long a cancelled call waits for its copy to stop touching its blocks


@dataclass(frozen=True)
class StoreResult:
    """What `TieredKVCache.store` did: keys now in the CPU tier (cascades follow in the
    background), keys that were there already, and whether the CPU tier had no room."""

    stored: list[bytes]
    already_present: int
    no_room: bool = False


@dataclass(frozen=True)
class CacheStats:
    """A cache's figures: ``str()`` for a person (`kvtier_async.metrics.summary`), the
    fields for code, `samples` for the Prometheus series."""

    ledger: LedgerStatistics
    tiers: list[TierMetrics]  # one per secondary tier, in order
    lanes: list[LaneStatistics]  # the engine's lanes' own state (queues, jobs by outcome)
    device: DeviceCounters  # the copies between the caller's blocks and the CPU tier
    lookups: int
    lookup_hits: int
    requests: int = 0  # named requests not finished yet
    probes: int = 0  # secondary-tier lookup answers held for them
    events_dropped: int = 0  # events a slow listener did not take in time

    def __str__(self) -> str:
        return summary(self)

    def samples(self) -> Samples:
        """The series of `kvtier_async.metrics.SERIES`, by name and label values."""
        return samples(self.ledger, self.tiers, self.device)


class TieredKVCache:
    """GPU/CPU <-> CPU region <-> secondary tiers, as awaitable calls."""

    def __init__(self, config: CacheConfig | Mapping[str, Any]) -> None:
        self.config = config if isinstance(config, CacheConfig) else CacheConfig.from_dict(config)
        # names the shared CPU region (one live cache per id): the config's, else one of ours
        self.instance_id = self.config.instance_id or f"kvtier-{os.getpid()}-{secrets.token_hex(4)}"
        self._region: SharedRegion | None = None
        self._blocks: BlockCopier | None = None  # the device lane's data path
        self._engine: Engine | None = None
        self._tiers: list[SecondaryTier] = []
        self._ledger: TieringLedger | None = None
        self._runner: TaskRunner | None = None
        self._progress = anyio.Event()
        self._lookups = self._lookup_hits = 0
        self._listeners: list[MemoryObjectSendStream[KVEvent]] = []
        self._events_dropped = 0
        self._final_stats: CacheStats | None = None

    # --- lifecycle ---------------------------------------------------------------------

    async def __aenter__(self) -> TieredKVCache:
        if self._region is not None or self._engine is not None:
            raise RuntimeError("this TieredKVCache is open already: enter it once at a time")
        cfg = self.config
        region = await anyio.to_thread.run_sync(_open_region, cfg, self.instance_id)
        self._region = region
        ctx = TierContext(
            block_bytes=region.row_bytes, model=cfg.model, instance_id=self.instance_id
        )
        try:
            self._blocks = BlockCopier(HostSlots.from_region(region), cfg.block_bytes)
            parts = assemble(cfg, cfg.num_slots, ctx)
            tiers, self._ledger = parts.tiers, parts.ledger
            self._ledger.events_enabled = False  # on while somebody listens: see `events`
            runner = parts.runner(on_applied=self._applied)
            engine = parts.engine(
                self._block_view,
                device=self._copy,
                device_workers=cfg.device_workers,
                on_result=runner.deliver,
            )
            await runner.__aenter__()
            try:
                await engine.__aenter__()
            except BaseException:
                await runner.__aexit__(None, None, None)
                raise
        except BaseException:
            await self._close_region()
            raise
        self._runner, self._engine, self._tiers = runner, engine, tiers
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Drain (cascades finish) on a clean exit, for at most ``close_timeout_s``; on an
        error, or then, cancel what is in flight."""
        engine, runner = self._engine, self._runner
        try:
            if engine is not None and exc_type is None and self.has_pending_work():
                with anyio.move_on_after(self.config.close_timeout_s) as drained:
                    await self.drain()
                if drained.cancelled_caught and self.has_pending_work():
                    _log_abandoned(engine, self.config.close_timeout_s)
        finally:
            self._engine, self._tiers = None, []
            try:
                if engine is not None:  # always: its task group was entered in this task
                    await engine.__aexit__(exc_type, exc, tb)
            finally:
                try:
                    if runner is not None:  # then the results of the jobs cancelled last
                        await runner.__aexit__(exc_type, exc, tb)
                finally:
                    if engine is not None and self._ledger is not None:
                        self._final_stats = self._stats(engine)
                    await self._close_region()

    async def _close_region(self) -> None:
        region, self._region = self._region, None
        blocks, self._blocks = self._blocks, None
        with anyio.CancelScope(shield=True):
            if blocks is not None:  # first: it holds a view of the region
                await anyio.to_thread.run_sync(blocks.close)
                del blocks
            if region is not None:
                await anyio.to_thread.run_sync(close_region, region)

    def _block_view(self, slot: int) -> memoryview:
        assert self._region is not None
        return self._region.slot_view(slot, padded=True)

    @property
    def ledger(self) -> TieringLedger:
        if self._ledger is None:
            raise RuntimeError("the cache is not open: use `async with TieredKVCache(...)`")
        return self._ledger

    @property
    def engine(self) -> Engine:
        self._require_open()
        assert self._engine is not None
        return self._engine

    def _require_open(self) -> None:
        if self._engine is None:
            raise RuntimeError("the cache is not open: use `async with TieredKVCache(...)`")

    @property
    def runner(self) -> TaskRunner:
        self._require_open()
        assert self._runner is not None
        return self._runner

    @property
    def tiers(self) -> list[SecondaryTier]:
        self._require_open()
        return self._tiers

    # --- lookup ------------------------------------------------------------------------

    async def lookup(self, keys: Sequence[bytes], req: Hashable | None = None) -> int:
        """How many leading keys are readable in the CPU tier, after promoting from the
        secondary tiers what they have (awaited: no RETRY dance for the caller)."""
        _check_keys(keys)
        self._require_open()
        await anyio.lowlevel.checkpoint()  # every call yields, hits or not (see `flush`)
        token = req if req is not None else object()
        if req is not None:  # the whole prefix, head first: its exact positions
            self.ledger.note_positions(req, keys)
        try:
            while True:
                progress = self._progress
                hits, pending = self.ledger.walk_prefix(token, [keys])
                if not pending:
                    self._lookups += len(keys)
                    self._lookup_hits += hits
                    return hits
                await self._flush()
                await progress.wait()
        finally:
            if req is None:
                self.ledger.request_finished(token)
            self._publish()

    async def flush(self) -> None:
        """Submit the work the ledger decided (promotions, lookups, cascades).

        Every public async call of the cache passes a checkpoint (a cancellation point and a
        turn for other tasks), even when it has nothing to wait for (all hits, no keys,
        nothing to submit): a task looping on such calls never starves the others, a
        deadline around it is honoured, and close gets its turn. The checkpoint comes before
        the call decides anything, except in `load`, where it is the submission right after
        the pins (see `load`)."""
        self._require_open()
        await anyio.lowlevel.checkpoint()
        await self._flush()

    async def _flush(self) -> None:
        jobs = self.runner.take_jobs()
        for index, job in enumerate(jobs):
            try:
                await self.engine.submit(job)
            except BaseException as exc:
                # Nothing of these was queued: give back what their tasks hold.
                self.runner.abandon(jobs[index:], exc)
                raise

    def _applied(self) -> None:
        """After the runner applied results: wake the lookups waiting, publish events."""
        self._signal()
        self._publish()

    def _signal(self) -> None:
        progress, self._progress = self._progress, anyio.Event()
        progress.set()

    # --- requests and events -----------------------------------------------------------

    def request(self, req: Hashable) -> CacheRequest:
        """``async with cache.request(req_id) as r:``: ``r.lookup / r.load / r.store`` are
        the cache's calls for request ``req_id``, finished when the block ends."""
        return CacheRequest(self, req)

    def request_finished(self, req: Hashable) -> None:
        """Request ``req`` ended: release what the cache kept for it (lookup answers, its
        place in the eviction order). Nothing to do for a closed cache."""
        if self._engine is not None and self._ledger is not None:
            self._ledger.request_finished(req)

    def events(self, buffer: int = 1024) -> _EventListener:
        """``async with cache.events() as stream: async for event in stream: ...``: the KV
        events from now on (`kvtier_async.events`). Up to ``buffer`` wait for the listener;
        beyond that they are dropped and counted, never waited for."""
        if buffer < 1:
            raise ValueError(f"buffer must be >= 1, got {buffer}")
        return _EventListener(self, buffer)

    def _listen(self, send: MemoryObjectSendStream[KVEvent]) -> None:
        self._listeners.append(send)
        self.ledger.events_enabled = True

    def _unlisten(self, send: MemoryObjectSendStream[KVEvent]) -> None:
        self._listeners.remove(send)
        send.close()
        if not self._listeners and self._ledger is not None:
            self._ledger.events_enabled = False  # also drops what is recorded

    def _publish(self) -> None:
        """Hand the ledger's new events to the listeners (none: nothing was recorded)."""
        if not self._listeners or self._ledger is None:
            return
        for event in to_kv_events(self._ledger.take_events()):
            for send in self._listeners:
                try:
                    send.send_nowait(event)
                except anyio.WouldBlock:
                    self._events_dropped += 1
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    pass  # the listener is leaving

    # --- store and load ----------------------------------------------------------------

    async def store(
        self, keys: Sequence[bytes], blocks: Sequence[Any], req: Hashable | None = None
    ) -> StoreResult:
        """Copy the blocks of keys not held yet into the CPU tier; the cascade to every
        secondary tier runs in the background (`drain` waits for it)."""
        _check_keys(keys)
        views = self._views(keys, blocks, writable=False)
        self._require_open()
        await anyio.lowlevel.checkpoint()
        out = self.ledger.prepare_store(keys, req)  # None: a request of its own, finished
        if out is None:
            return StoreResult([], 0, no_room=True)
        stored = out.keys_to_store
        if stored:
            position = {key: i for i, key in enumerate(keys)}
            payload = (out.store_spec.slot_ids, [views[position[key]] for key in stored])
            result = await self._run(Job(JobKind.STORE, tuple(stored), payload))
            stored = result.succeeded
        await self._flush()
        self._publish()
        return StoreResult(stored, len(set(keys)) - len(out.keys_to_store))

    async def load(
        self, keys: Sequence[bytes], blocks: Sequence[Any], req: Hashable | None = None
    ) -> int:
        """Copy readable keys (see `lookup`) from the CPU tier into ``blocks``; how many
        arrived. Raises `LedgerError` if a key is not readable. Called right after `lookup`
        (no other await between them), the hits it answered are readable still: neither
        call yields between its answer and the load's pins."""
        _check_keys(keys)
        views = self._views(keys, blocks, writable=True)
        self._require_open()
        if not keys:
            await anyio.lowlevel.checkpoint()
            return 0
        # No checkpoint before the pins: between `lookup` returning its hits and this
        # `prepare_load`, nothing else runs, so the hits are still there (another task's
        # store could evict them otherwise). The submission right after is the checkpoint;
        # cancelled there, the pins are given back.
        slots = self.ledger.prepare_load(keys, req)  # a reuse (None: by a call of its own)
        result = await self._run(Job(JobKind.LOAD, tuple(keys), (slots, views)))
        return sum(result.ok)

    async def _run(self, job: Job) -> JobResult:
        """Submit and await a device job, and apply its result before returning (so a
        store's blocks are readable, a load's pins released). Whatever happens, its result
        (or, if it was never queued, its failure) releases what the ledger reserved for it.

        The job holds views of the caller's blocks: when the caller is cancelled, the job is
        cancelled and awaited (shielded) before the cancellation goes on, so nothing of ours
        reads or writes the caller's memory once the call has returned. A host copy checks
        for cancellation between pieces of a few MiB and a device copy is one short DMA
        (`kvtier_async.transfer.blocks`), so this wait is short."""
        runner = self.runner
        try:
            handle = await self.engine.submit(job)
        except BaseException as exc:
            runner.abandon([job], exc)
            raise
        try:
            result = await handle
        except JobError as exc:
            result = exc.result
        except BaseException:
            handle.cancel()
            with anyio.CancelScope(shield=True), anyio.move_on_after(_LET_GO_S) as waited:
                await handle.wait_ended()
            if waited.cancelled_caught:  # a copy stuck in the device: nothing else to do
                log.error(
                    "a cancelled copy did not stop in time; it may still use the caller's blocks",
                    job_id=job.job_id,
                    kind=job.kind.value,
                    waited_s=_LET_GO_S,
                )
            raise
        runner.apply_delivered()  # this result, and any delivered before it
        return result

    # --- device copies (the device lane's executor) ------------------------------------

    def _views(self, keys: Sequence[bytes], blocks: Sequence[Any], *, writable: bool) -> list[Any]:
        if len(keys) != len(blocks):
            raise ValueError(f"{len(keys)} keys but {len(blocks)} blocks")
        return [
            _as_bytes(block, self.config.block_bytes, i, writable) for i, block in enumerate(blocks)
        ]

    async def _copy(self, job: Job) -> tuple[Sequence[bool], int]:
        """Run a store or load with the transfer path (`BlockCopier`): the plan copiers the
        vLLM worker's handlers use too."""
        slot_ids, views = job.payload
        assert self._blocks is not None
        nbytes = await self._blocks.copy(slot_ids, views, to_host=job.kind is JobKind.STORE)
        return (True,) * len(views), nbytes

    # --- state -------------------------------------------------------------------------

    async def drain(self) -> None:
        """Wait until every job in flight (cascades included) ended."""
        while True:
            await self._flush()
            await self.engine.drain()  # a checkpoint, idle or not
            self.runner.apply_delivered()  # what ended since the owner task's last turn
            if not self.ledger.has_pending_work():
                return

    async def reset(self) -> None:
        """Drain, then clear the CPU tier; the secondary tiers keep their data. Listeners
        get one `AllBlocksCleared` (medium ``CPU``) for the blocks the CPU tier forgot."""
        await self.drain()
        self.ledger.reset()
        self._publish()

    def has_pending_work(self) -> bool:
        """Work decided, in flight, or ended with its result not applied yet."""
        return (
            self.ledger.has_pending_work()
            or self.engine.has_pending_work()
            or self.runner.has_pending_work()
        )

    def stats(self) -> CacheStats:
        """The cache's figures now (`CacheStats`; ``str()`` of it is a short summary).
        Counters are final once `drain` returned; after the cache closed, the final
        figures (raises only if the cache was never opened)."""
        if self._engine is None and self._final_stats is not None:
            return self._final_stats
        return self._stats(self.engine)

    def register_metrics(self, registry: Any) -> CacheCollector:
        """Expose the per-tier series (`kvtier_async.metrics.SERIES`) to ``registry``, a
        ``prometheus_client.CollectorRegistry`` (pass ``prometheus_client.REGISTRY`` for the
        global one; nothing is registered anywhere else). Each scrape reads the cache's
        figures: before it opens there are none, after it closed the final ones. Returns the
        collector (``registry.unregister(collector)`` removes it)."""
        collector = CacheCollector(self._scrape)
        registry.register(collector)
        return collector

    def _scrape(self) -> Samples | None:
        """What a scrape shows (perhaps from another thread: see `kvtier_async.metrics`)."""
        engine, final = self._engine, self._final_stats
        if engine is not None:
            return self._stats(engine).samples()
        return final.samples() if final is not None else None  # None: not opened yet

    def _stats(self, engine: Engine) -> CacheStats:
        ledger = self.ledger
        engine_tiers = cast("list[SecondaryTier]", engine.tiers)  # the tiers this cache made
        return CacheStats(
            ledger.primary.statistics(),
            tier_metrics(engine_tiers, engine.queue_depths()),
            engine.statistics(),
            engine.device_counters.copy(),
            self._lookups,
            self._lookup_hits,
            ledger.primary.num_requests,
            ledger.num_probes,
            self._events_dropped,
        )


_KEY_BYTES = (5, 4 + 64)  # a block hash of 1-64 bytes and a 4-byte group index


def _check_keys(keys: object) -> None:
    """Refuse, before anything is reserved, what is not a sequence of offload keys."""
    if isinstance(keys, (str, bytes, bytearray, memoryview)) or not isinstance(keys, Sequence):
        raise TypeError(
            "keys: must be a list of offload keys (bytes from make_offload_key), "
            f"got {type(keys).__name__}"
        )
    low, high = _KEY_BYTES
    for index, key in enumerate(keys):
        if type(key) is not bytes:
            raise TypeError(
                f"keys[{index}]: must be bytes (from make_offload_key), got {type(key).__name__}"
            )
        if not low <= len(key) <= high:
            raise ValueError(
                f"keys[{index}]: must be {low}-{high} bytes (a block hash and a 4-byte group "
                f"index, see make_offload_key), got {len(key)}"
            )


def _open_region(cfg: CacheConfig, instance_id: str) -> SharedRegion:
    """The CPU tier's region, pinned for DMA when CUDA is present (a no-op without; a failed
    registration is logged and copies use pageable memory)."""
    region = SharedRegion(
        instance_id,
        cfg.num_slots,
        cfg.block_bytes,
        directory=cfg.region_dir,
        role="worker",  # one cache per instance_id: a second live one is refused
        token=secrets.token_hex(8),
    )
    try:
        region.register_cuda()
    except BaseException:
        close_region(region)
        raise
    return region


def _log_abandoned(engine: Engine, waited_s: float) -> None:
    lanes = {
        lane.name: lane.running + lane.queued_reads + lane.queued_writes
        for lane in engine.statistics()
    }
    busy = {name: count for name, count in lanes.items() if count}
    log.warning(
        "cache closed before its jobs ended; cancelling them",
        close_timeout_s=waited_s,
        jobs=sum(busy.values()),
        lanes=busy,
    )


def _as_bytes(block: Any, block_bytes: int, index: int, writable: bool) -> Any:
    """A zero-copy flat uint8 view of one block: numpy for host memory, a `DeviceBlock` (the
    tensor and the caller's current stream) for a CUDA tensor."""
    if hasattr(block, "data_ptr") and hasattr(block, "is_cuda"):
        return _tensor_bytes(block, block_bytes, index, writable)
    try:
        array = np.asarray(memoryview(block) if not isinstance(block, np.ndarray) else block)
    except TypeError as exc:
        raise TypeError(
            f"blocks[{index}]: a tensor, array or buffer is needed, got {type(block).__name__}"
        ) from exc
    if not array.flags.c_contiguous:
        raise ValueError(f"blocks[{index}] must be contiguous")
    flat = array.reshape(-1).view(np.uint8)
    if flat.nbytes != block_bytes:
        raise ValueError(f"blocks[{index}] has {flat.nbytes} bytes, block_bytes is {block_bytes}")
    if writable and not flat.flags.writeable:
        raise ValueError(f"blocks[{index}] is read-only: a load writes into it")
    return flat


def _tensor_bytes(tensor: Any, block_bytes: int, index: int, writable: bool) -> Any:
    import torch

    if not tensor.is_contiguous():
        raise ValueError(f"blocks[{index}] must be contiguous")
    flat = tensor.reshape(-1).view(torch.uint8)
    if flat.numel() != block_bytes:
        raise ValueError(f"blocks[{index}] has {flat.numel()} bytes, block_bytes is {block_bytes}")
    if flat.device.type == "cpu":
        if writable and not flat.untyped_storage().resizable():
            # torch keeps no read-only flag, but it marks every storage whose memory it did
            # not allocate (torch.frombuffer of a bytes object or of a read-only mmap,
            # torch.from_numpy) or that it handed to numpy (Tensor.numpy) as not resizable:
            # such memory may be memory nobody may write. Refused before any copy.
            raise ValueError(
                f"blocks[{index}] is a CPU tensor over memory torch did not allocate "
                "(torch.frombuffer, torch.from_numpy, or exported with Tensor.numpy), which "
                "may be read-only: pass the numpy array or buffer itself (its read-only flag "
                "is checked) or a tensor torch allocated"
            )
        return np.asarray(_TensorBytes(flat))
    if flat.device.type != "cuda":
        raise ValueError(
            f"blocks[{index}] is on {flat.device}: blocks must be in CPU memory or on a CUDA device"
        )
    return DeviceBlock.of(flat)


class _TensorBytes:
    """A CPU uint8 tensor as a numpy array (``np.asarray`` of this) that keeps the tensor
    alive, made without ``Tensor.numpy()``: that would mark the tensor's storage as not
    resizable, and so as memory torch did not allocate, to every later load."""

    def __init__(self, flat: Any) -> None:
        self.tensor = flat
        self.__array_interface__ = {
            "shape": (int(flat.numel()),),
            "typestr": "|u1",
            "data": (int(flat.data_ptr()), False),
            "version": 3,
        }


class CacheRequest:
    """One request's calls on a `TieredKVCache` (see `TieredKVCache.request`)."""

    def __init__(self, cache: TieredKVCache, req: Hashable) -> None:
        if req is None:
            raise ValueError("req: a request id is needed (any hashable but None)")
        self.cache = cache
        self.req = req

    async def __aenter__(self) -> CacheRequest:
        await anyio.lowlevel.checkpoint()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.cache.request_finished(self.req)
        await anyio.lowlevel.cancel_shielded_checkpoint()  # released first, whatever happens

    async def lookup(self, keys: Sequence[bytes]) -> int:
        """`TieredKVCache.lookup` for this request: ``keys`` is the whole prefix, head first."""
        return await self.cache.lookup(keys, self.req)

    async def load(self, keys: Sequence[bytes], blocks: Sequence[Any]) -> int:
        return await self.cache.load(keys, blocks, self.req)

    async def store(self, keys: Sequence[bytes], blocks: Sequence[Any]) -> StoreResult:
        return await self.cache.store(keys, blocks, self.req)


class _EventListener:
    """The async context manager `TieredKVCache.events` returns."""

    def __init__(self, cache: TieredKVCache, buffer: int) -> None:
        self._cache = cache
        self._send, self._receive = anyio.create_memory_object_stream[KVEvent](buffer)

    async def __aenter__(self) -> MemoryObjectReceiveStream[KVEvent]:
        try:
            await anyio.lowlevel.checkpoint()
        except BaseException:  # cancelled before listening: nothing of it stays open
            self._send.close()
            self._receive.close()
            raise
        self._cache._listen(self._send)
        return self._receive

    async def __aexit__(self, *exc_info: object) -> None:
        self._cache._unlisten(self._send)
        self._receive.close()
        await anyio.lowlevel.cancel_shielded_checkpoint()
