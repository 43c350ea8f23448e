"""The connector's scheduler role: the ledger on vLLM's scheduler thread, tier I/O on a loop.

Per step, vLLM calls (on its scheduler thread, never blocked on I/O here; see "Idle steps"
below for the one bounded wait):

- ``get_num_new_matched_tokens``: apply finished work, then walk the request's offload keys
  from its first block not computed locally. A tier that has not answered makes the answer
  None ("ask again"), and so does a job of the request still in flight. Hits are pinned at
  once (the pins wait for ``update_state_after_alloc``, or are released when the request is
  asked again or ends), and loaded asynchronously. vLLM asks a request again each step it
  could not schedule it: the answer is kept in one memo per request (``_Request.walked``)
  with the ledger's `TieringLedger.version` and the walk's bounds (the local tokens, the
  last block), and an ask with the same bounds while the version is the same gets it
  again without a walk (with the pins it holds). That is the memo's one rule: the version
  changes with every change of the ledger that could change a walk's answer (a key stored,
  written, evicted, pinned or unpinned, a tier's answer, a promotion). The request's own
  state is checked before the memo: a job in flight, a cache reset's fence or a failed
  load answer as they always do. Without tiers a walk changes nothing, so a request asked
  again with its hits pinned keeps the pins while the walk finds the same hits.
- ``update_state_after_alloc``: pair the hit keys with the GPU blocks vLLM allocated
  (``block_size_factor`` GPU blocks per key; the first may start inside a key's span).
- ``build_connector_meta``: choose what to store (reference 3.1): tokens computed or
  scheduled this step, clamped to the prompt with ``offload_prompt_only``, whole offloaded
  blocks only, a per-request per-group cursor, hit blocks skipped (BLOCK_LEVEL), blocks
  with id 0 skipped. Stores whose GPU blocks this step hands to another request are flushed
  (the workers finish them before the forward pass). Then the tier work the ledger decided
  (lookups, promotions, cascades) goes to the engine, and the loop is woken once.
- ``update_connector_output``: a device job completes when every worker reported it.

The tier side (`.tier_work.TierWork`: the runner, the tier engine on its thread, the CPU
region, when cascades go out, the wait of an idle step, the flush) is its own module, with
its own account of how tier results come back.

``reset_cache`` flushes every tier job (`ThreadedEngine.flush`, ``wait_timeout_s`` at most):
a cascade reads a CPU slot and a promotion writes one, and the reset frees them all. If a
job cannot be made to end in time it does not raise into vLLM: the reset is refused
(``None``, vLLM's ``False``), with a warning naming the jobs; the jobs go on and their
results apply as usual. The device jobs in flight are flushed by the workers at the next
step; until every worker reported them (a job abandoned at a worker's deadline is reported
only once its copy ended), a fence holds new stores and lookups, so no freed slot is
reused while a late copy may still touch it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from kvtier_async._log import get_logger
from kvtier_async.assembly import assemble
from kvtier_async.ledger import (
    CPUSpec,
    GPUSpec,
    LedgerStatistics,
    OffloadingEvent,
    PrepareStoreOutput,
    StorePolicy,
    make_offload_keys,
)
from kvtier_async.metrics import TierMetrics
from kvtier_async.tiers.base import TierContext

from .config import ConnectorConfig
from .device_jobs import DeviceJobs
from .layout import OffloadLayout
from .metadata import DeviceJob, KVTierMetadata, KVTierWorkerMetadata
from .tier_work import TierWork

__all__ = ["ConnectorScheduler"]

log = get_logger(__name__)


class _Walk(NamedTuple):
    """An ask's walk: the ledger's version after it (its pins taken), its bounds and its
    answer: the tokens hit (0: none), None for "ask again"."""

    version: int
    local_tokens: int  # vLLM's num_computed_tokens
    last: int  # the end of the walk (exclusive), in offloaded blocks
    tokens: int | None


@dataclass
class _Request:
    req: Any  # vllm.v1.request.Request
    keys: list[list[bytes]]  # per group, per offloaded block
    block_ids: list[list[int]]  # per group, the request's GPU block table
    cursor: list[int]  # per group: offloaded blocks considered for storing
    jobs: set[int] = field(default_factory=set)
    pinned: list[bytes] = field(default_factory=list)  # hits pinned, not yet loading
    pinned_slots: npt.NDArray[np.int64] | None = None  # their CPU slots (pins keep them)
    pinned_tokens: int = 0  # the answer the pins were taken for
    walked: _Walk | None = None  # the last ask's walk and answer (the module docstring)
    num_local_tokens: int = 0
    finished: bool = False
    load_failed: bool = False  # then the request recomputes instead of loading again

    @property
    def waiting_on(self) -> _Walk | None:
        """The memo while its walk waits on a key (the answer "ask again"), else None."""
        walked = self.walked
        return walked if walked is not None and walked.tokens is None else None


class ConnectorScheduler:
    """vLLM's scheduler-side connector hooks (see the module docstring): the requests, their
    walks, pins and device jobs; the tier side is `tier_work`."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig) -> None:
        self.config = config
        self.layout = OffloadLayout.from_vllm(vllm_config, kv_cache_config, config)
        layout = self.layout
        self.instance_id = layout.instance_id
        ctx = TierContext(
            block_bytes=layout.block_span_bytes,
            model=layout.model,
            block_tokens=layout.chunk_tokens,
            dtype=layout.dtype,
            kv_layout=layout.kv_layout,
            tp_size=layout.tp_size,
            pp_size=layout.pp_size,
            instance_id=layout.instance_id,
        )
        parts = assemble(config, layout.num_slots, ctx)
        self.ledger, self.tiers = parts.ledger, parts.tiers
        self._reqs: dict[str, _Request] = {}
        # Running requests with nothing left to store (``offload_prompt_only``): a request
        # joins when its cursors reach its prompt's end (`_maybe_settle`) and leaves when
        # they go back to 0 (`_rewind`) or it is dropped; stores skip it. Not a walk memo.
        self._settled: set[str] = set()
        self._jobs = DeviceJobs(layout.num_workers)  # the copies the workers run
        self._step_loads: dict[int, DeviceJob] = {}
        # This step's sync loads: the requests, and their bytes (one worker's).
        self._step_sync: set[str] = set()
        self._step_sync_bytes = 0
        self._kv_bytes_per_token = layout.slot_bytes // layout.chunk_tokens
        self._step_allocated: set[int] = set()
        self.store_allocation_failures = 0  # stores the CPU tier had no room for
        self.tier_work = TierWork(parts, layout, config)  # the runner, the engine, the region

    # --- lookups ----------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        groups = len(self.layout.groups)
        self._reqs[request.request_id] = _Request(
            request, [[] for _ in range(groups)], [[] for _ in range(groups)], [0] * groups
        )

    def _state(self, request: Any) -> _Request:
        st = self._reqs.get(request.request_id)
        if st is None:
            self.on_new_request(request)
            st = self._reqs[request.request_id]
        return st

    def _update_keys(self, st: _Request) -> None:
        """Keys for the request's new full offloaded blocks (every group has as many)."""
        hashes, factor = st.req.block_hashes, self.layout.factor
        start = len(st.keys[0])
        if (start + 1) * factor > len(hashes):
            return  # no new full block: the common case of a re-asked request
        first = (start + 1) * factor - 1
        for keys, group in zip(st.keys, self.layout.groups):
            new = make_offload_keys(hashes[first::factor], group)
            keys += new
            # A key's position: its block's end, as vLLM's scheduler sets it.
            self.ledger.note_positions(st.req.request_id, new, start + 1)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self.tier_work.drain()
        st = self._state(request)
        self._rewind(st)  # (re)starting: offer every block again
        st.block_ids = [[] for _ in st.block_ids]
        if st.jobs:
            self._unpin(st)
            return None, False
        if self._jobs.fenced or st.load_failed:
            # No promotion into a slot a late copy may touch; a failed load recomputes.
            self._unpin(st)
            return 0, False
        self._update_keys(st)
        # At least one token must be left to compute: never the request's last token.
        last = min(len(st.keys[0]), (request.num_tokens - 1) // self.layout.chunk_tokens)
        walked = st.walked
        if (
            walked is not None
            and walked.version == self.ledger.version
            and walked.local_tokens == num_computed_tokens
            and walked.last == last
        ):
            tokens = walked.tokens
            if tokens is None or not tokens:
                return tokens, False
            if st.pinned:
                return tokens, self._load_async(st, num_computed_tokens)
        return self._walk(st, num_computed_tokens, last)

    def _walk(self, st: _Request, num_computed_tokens: int, last: int) -> tuple[int | None, bool]:
        """Walk the request's keys from its first block not computed locally to ``last``,
        pin the hits and answer; the answer goes into the memo (see the module
        docstring). Pins the request holds are released first, unless no tier can change
        what the walk reads (no promotion): then they stay if it finds the same hits."""
        ledger, chunk = self.ledger, self.layout.chunk_tokens
        kept = 0  # the tokens of the pins kept through the walk
        if st.pinned:
            if self.tiers or st.num_local_tokens != num_computed_tokens:
                self._unpin(st)
            else:
                kept = st.pinned_tokens
        st.num_local_tokens = num_computed_tokens
        first = num_computed_tokens // chunk
        req_id = st.req.request_id
        hits, pending = ledger.walk_prefix(req_id, [keys[first:last] for keys in st.keys])
        tokens = None if pending else max(0, (first + hits) * chunk - num_computed_tokens)
        if tokens != kept:
            self._unpin(st)
            if tokens:
                keys = self._chunk_keys(st, first, first + hits)
                # A reuse, as vLLM's prepare_load.
                st.pinned_slots = ledger.prepare_load(keys, req_id)
                st.pinned = keys
                st.pinned_tokens = tokens
        # Kept unless the walk's own promotion evicted a key of its prefix (it may have
        # read it as a hit): then the next ask walks again.
        st.walked = (
            _Walk(ledger.version, num_computed_tokens, last, tokens) if ledger.walk_stable else None
        )
        if not tokens:
            return tokens, False
        return tokens, self._load_async(st, num_computed_tokens)

    def _load_async(self, st: _Request, num_computed_tokens: int) -> bool:
        """Whether the hit pinned for ``st`` loads asynchronously (vLLM's default), or
        within this step, before its forward pass: a sync load, as vLLM 0.33's connector
        makes one, while the step's loads fit ``sync_load_budget_bytes`` (the tokens times
        one worker's KV bytes per token; 0, the default, makes none). A sync load saves the
        request an engine step; where the KV cache is in host memory (vLLM's CPU backend)
        its copy takes a few milliseconds in the worker's ``start_load_kv``."""
        req_id = st.req.request_id
        self._step_sync.discard(req_id)
        budget = self.config.sync_load_budget_bytes
        tokens = st.pinned_tokens
        if not budget or num_computed_tokens + tokens >= st.req.num_tokens:
            return True
        nbytes = tokens * self._kv_bytes_per_token
        if self._step_sync_bytes + nbytes > budget:
            return True
        self._step_sync_bytes += nbytes
        self._step_sync.add(req_id)
        return False

    def _chunk_keys(self, st: _Request, start: int, end: int) -> list[bytes]:
        return [key for keys in st.keys for key in keys[start:end]]

    def _unpin(self, st: _Request) -> None:
        if st.pinned:
            self.ledger.complete_load(st.pinned)
            st.pinned, st.pinned_slots = [], None

    # --- loads ------------------------------------------------------------------------

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Pair the hit keys with the GPU blocks vLLM allocated. The blocks a load writes
        count as handed on this step (stores reading them are flushed); the request's other
        blocks are marked by ``build_connector_meta`` when vLLM schedules it."""
        if num_external_tokens == 0:
            return
        st = self._state(request)
        layout = self.layout
        cached = st.num_local_tokens + num_external_tokens
        first_chunk = st.num_local_tokens // layout.chunk_tokens
        end_chunk = cached // layout.chunk_tokens
        keys = self._chunk_keys(st, first_chunk, end_chunk)
        slots = self._take_pins(st, keys)
        first_gpu = st.num_local_tokens // layout.gpu_block_size
        end_gpu = cached // layout.gpu_block_size
        ids: list[int] = []
        for group in layout.groups:
            ids += [b.block_id for b in blocks.blocks[group][first_gpu:end_gpu]]
        groups = len(layout.groups)
        spec = GPUSpec(
            np.array(ids, dtype=np.int64),
            (end_gpu - first_gpu,) * groups,
            (first_gpu % layout.factor,) * groups,
        )
        self._step_allocated.update(ids)
        job_id = self._new_job(st, keys, is_store=False, blocks=ids)
        sync = request.request_id in self._step_sync
        self._jobs[job_id].sync = sync
        self._step_loads[job_id] = DeviceJob(
            request.request_id, spec, CPUSpec(slots), False, sync=sync
        )
        if self.ledger.store_policy is StorePolicy.BLOCK_LEVEL:
            st.cursor = [max(c, end_chunk) for c in st.cursor]

    def _take_pins(self, st: _Request, keys: list[bytes]) -> npt.NDArray[np.int64]:
        """Hand the pins of ``keys`` to a load job (their slots); release the other pins."""
        pinned_slots, st.pinned_slots = st.pinned_slots, None
        if keys == st.pinned and pinned_slots is not None:  # the usual case: every hit
            st.pinned = []
            return pinned_slots
        wanted = set(keys)
        if not wanted.issubset(st.pinned):
            raise RuntimeError(
                f"request {st.req.request_id}: vLLM asked to load more tokens "
                "than get_num_new_matched_tokens offered"
            )
        if len(wanted) < len(st.pinned):
            self.ledger.complete_load([key for key in st.pinned if key not in wanted])
        st.pinned = []
        slots = self.ledger.slots_of(keys)
        if None in slots:
            raise RuntimeError("a pinned key left the CPU tier")  # pins prevent this
        return np.array(slots, dtype=np.int64)

    def _new_job(
        self, st: _Request, keys: Sequence[bytes], *, is_store: bool, blocks: list[int]
    ) -> int:
        job_id = self._jobs.new(st.req.request_id, keys, is_store=is_store, blocks=blocks)
        st.jobs.add(job_id)
        return job_id

    # --- the end of a step: stores, flushes, tier work -------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> KVTierMetadata:
        self.tier_work.drain()
        self._update_block_tables(scheduler_output)
        flush = self._jobs_to_flush(scheduler_output)
        stores: dict[int, DeviceJob] = {}
        finished = set(scheduler_output.finished_req_ids or ())
        settled, scheduled = self._settled, scheduler_output.num_scheduled_tokens
        finished_stores: Iterable[str] = finished
        if self._jobs.fenced:  # no store into a slot a late copy may touch: offered later
            scheduled, finished_stores = {}, ()
        reqs = self._reqs
        # A settled request's prompt blocks were all considered: nothing to store.
        for req_id in [r for r in itertools.chain(scheduled, finished_stores) if r not in settled]:
            st = reqs.get(req_id)
            if st is not None:
                self._build_store(st, scheduled.get(req_id, 0), stores)
        allocated, jobs = self._step_allocated, self._jobs
        for job_id, job in stores.items():
            # A finished request's blocks were freed; if this step hands one to another
            # request, its store must be done before the forward pass writes there.
            st = self._reqs[job.req_id]
            if st.req.is_finished() and not allocated.isdisjoint(jobs[job_id].blocks):
                flush.add(job_id)
        for req_id in finished:
            self._finish(req_id)
        meta = KVTierMetadata(self._step_loads, stores, flush)
        self._step_loads, self._step_allocated = {}, set()
        if self._step_sync_bytes:
            self._step_sync, self._step_sync_bytes = set(), 0
        self.tier_work.submit()
        if not scheduler_output.total_num_scheduled_tokens:
            self.tier_work.wait_idle()
        return meta

    def _update_block_tables(self, out: Any) -> None:
        for data in out.scheduled_new_reqs:
            self._set_blocks(data.req_id, data.block_ids, full=True)
        cached = out.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or ()
        new_block_ids = cached.new_block_ids  # None where a request got no new block
        for req_id, new_ids in zip(
            itertools.compress(cached.req_ids, new_block_ids), filter(None, new_block_ids)
        ):
            self._set_blocks(req_id, new_ids, full=req_id in resumed)

    def _set_blocks(self, req_id: str, groups: Sequence[list[int]] | None, *, full: bool) -> None:
        st = self._reqs.get(req_id)
        if st is None or groups is None:
            return
        for g, group in enumerate(self.layout.groups):
            if full:
                st.block_ids[g] = list(groups[group])
            else:
                st.block_ids[g].extend(groups[group])
            self._step_allocated.update(groups[group])
        self._step_allocated.discard(0)  # the null block: never handed to a request

    def _jobs_to_flush(self, out: Any) -> set[int]:
        """In-flight stores of preempted requests, and stores reading a GPU block that this
        step hands to a request: the workers finish them before the forward pass."""
        flush: set[int] = set()
        for req_id in out.preempted_req_ids or ():
            st = self._reqs.get(req_id)
            if st is not None:
                flush |= {j for j in st.jobs if self._jobs[j].is_store or self._jobs[j].sync}
        allocated = self._step_allocated
        if allocated:  # the stores in flight are few: each is checked (in C)
            flush.update(
                job_id
                for job_id, job in self._jobs.items()
                if job.is_store and not allocated.isdisjoint(job.blocks)
            )
        return flush

    def _build_store(self, st: _Request, num_scheduled: int, stores: dict[int, DeviceJob]) -> None:
        req, layout = st.req, self.layout
        finished = req.is_finished()
        self._update_keys(st)
        if finished:
            tokens = max(req.num_prompt_tokens, req.num_tokens - 1)
            tokens = min(tokens, req.num_computed_tokens) if _aborted(req) else tokens
        else:
            tokens = req.num_computed_tokens + num_scheduled
        if self.config.offload_prompt_only:
            tokens = min(tokens, req.num_prompt_tokens)
        block_ids, cursor = st.block_ids, st.cursor
        chunks = min(
            tokens // layout.chunk_tokens,
            min(map(len, block_ids)) // layout.factor,
            len(st.keys[0]),  # every group has as many keys
        )
        if chunks > min(cursor):
            offer, where = self._offer(st, chunks)
            if offer:
                out = self.ledger.prepare_store(offer, req.request_id)
                if out is None:
                    self.store_allocation_failures += 1
                    log.warning(
                        "no room in the CPU tier for a store; retried next step",
                        req_id=req.request_id,
                        blocks=len(offer),
                    )
                    return
                keys = out.keys_to_store
                if len(keys) < len(offer):  # keys_to_store keeps the offered order
                    position = dict(zip(offer, where))
                    where = [position[key] for key in keys]
                if keys:
                    self._add_store(st, keys, where, out, stores)
            st.cursor = [max(c, chunks) for c in cursor]
        if self.config.offload_prompt_only and not finished:
            self._maybe_settle(st)

    def _offer(self, st: _Request, chunks: int) -> tuple[list[bytes], list[tuple[int, int]]]:
        """The keys of each group's offloaded blocks from its cursor to ``chunks`` whose GPU
        blocks are all allocated (a block id 0 is a hole, as of a sliding window), and the
        (group, offloaded block) of each."""
        factor = self.layout.factor
        offer: list[bytes] = []
        where: list[tuple[int, int]] = []
        for g, (keys, ids, first) in enumerate(zip(st.keys, st.block_ids, st.cursor)):
            if first >= chunks:
                continue
            if 0 not in ids[first * factor : chunks * factor]:  # the rule: no hole at all
                offer += keys[first:chunks]
                where += [(g, c) for c in range(first, chunks)]
                continue
            for c in range(first, chunks):
                if all(ids[c * factor : (c + 1) * factor]):
                    offer.append(keys[c])
                    where.append((g, c))
        return offer, where

    def _rewind(self, st: _Request) -> None:
        """Offer every block of the request again: its cursors back to 0, so it is not
        settled any more."""
        st.cursor = [0] * len(st.cursor)
        self._settled.discard(st.req.request_id)

    def _maybe_settle(self, st: _Request) -> None:
        """With ``offload_prompt_only``, a running request whose cursors passed its prompt
        has nothing more to store: later steps skip it without a call."""
        if min(st.cursor) >= st.req.num_prompt_tokens // self.layout.chunk_tokens:
            self._settled.add(st.req.request_id)

    def _add_store(
        self,
        st: _Request,
        keys: list[bytes],
        where: list[tuple[int, int]],
        out: PrepareStoreOutput,
        stores: dict[int, DeviceJob],
    ) -> None:
        """A store job of ``keys``, the (group, offloaded block) of each in ``where``
        (group by group, as offered)."""
        factor = self.layout.factor
        block_ids = st.block_ids
        ids: list[int]
        if factor == 1 and len(block_ids) == 1:  # one GPU block per key, one group
            row = block_ids[0]
            ids = [row[c] for _, c in where]
            sizes = [len(ids)]
        else:
            ids = []
            sizes = [0] * len(block_ids)
            for g, c in where:
                ids += block_ids[g][c * factor : (c + 1) * factor]
                sizes[g] += factor
        job_id = self._new_job(st, keys, is_store=True, blocks=ids)
        spec = GPUSpec(np.array(ids, dtype=np.int64), tuple(sizes), (0,) * len(sizes))
        stores[job_id] = DeviceJob(st.req.request_id, spec, out.store_spec, True)

    def _finish(self, req_id: str) -> None:
        st = self._reqs.get(req_id)
        if st is None:
            return
        st.finished = True
        self.ledger.request_finished(req_id)  # after its last store, as vLLM does
        if not st.jobs:
            self._forget(req_id)

    def _forget(self, req_id: str) -> None:
        """Drop a finished request (the ledger heard of its end in `_finish`)."""
        self._settled.discard(req_id)
        st = self._reqs.pop(req_id)
        self._unpin(st)

    # --- results ----------------------------------------------------------------------

    def update_connector_output(self, output: Any) -> None:
        meta = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(meta, KVTierWorkerMetadata):
            for job_id, count in meta.completed.items():
                self._job_reported(job_id, count, job_id in meta.failed)
        self.tier_work.drain()

    def _job_reported(self, job_id: int, count: int, failed: bool) -> None:
        job = self._jobs.reported(job_id, count, failed)
        if job is None:
            return  # workers still to report it (or one from before a reset)
        self.tier_work.copy_done(job.is_store, job.keys, not job.failed, job_id)
        st = self._reqs.get(job.req_id)
        if st is not None:
            st.jobs.discard(job_id)
            st.load_failed |= job.failed and not job.is_store
            if st.finished and not st.jobs:
                self._forget(job.req_id)

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """GPU blocks are freed at once: pending stores are flushed if they get reused."""
        st = self._reqs.get(request.request_id)
        if st is not None:
            self._unpin(st)
        return False, None

    def has_pending_work(self) -> bool:
        jobs = self._jobs
        return bool(len(jobs) or jobs.fenced or self.tier_work.has_pending_work())

    def take_events(self) -> list[OffloadingEvent]:
        return self.ledger.take_events()

    def statistics(self) -> tuple[LedgerStatistics, list[TierMetrics]]:
        """The CPU ledger's slots and each tier's figures (`TierWork.statistics`)."""
        return self.tier_work.statistics()

    def reset_cache(self) -> set[int] | None:
        """Flush the tier jobs, forget the device jobs in flight (the workers are told to
        flush them; a fence waits for their reports), clear the CPU tier; returns the
        device jobs to flush, or None when a tier job could not be made to end in time
        (nothing was reset then)."""
        if not self.tier_work.flush():
            return None
        flushed = self._jobs.fence()
        for st in self._reqs.values():
            st.jobs.clear()
            st.pinned, st.pinned_slots = [], None
            self._rewind(st)
        # A request that ended before the reset is dropped, as vLLM's connector drops it:
        # its GPU blocks were freed (vLLM's own reset dropped their hashes), so its last
        # blocks are not stored in the new generation, whether or not this step's
        # ``finished_req_ids`` named it yet.
        for req_id in [r for r, st in self._reqs.items() if st.finished or st.req.is_finished()]:
            if not self._reqs[req_id].finished:
                self.ledger.request_finished(req_id)
            self._forget(req_id)
        self.ledger.reset()
        for req_id, st in self._reqs.items():  # the reset dropped the positions too
            for keys in st.keys:
                self.ledger.note_positions(req_id, keys)
        return flushed

    def shutdown(self) -> None:
        """The last tier jobs, then the tier engine and the region (`TierWork.close`)."""
        self.tier_work.close()


def _aborted(req: Any) -> bool:
    return str(getattr(req.status, "name", "")) == "FINISHED_ABORTED"
