"""The connector's worker role: canonical KV views, the CPU region's rows, device jobs.

The V2 model runner calls, per step: ``handle_preemptions`` (stores deferred from the last
step are submitted, and the jobs the scheduler asks to flush are waited for: their GPU
blocks are about to be overwritten), ``start_load_kv`` (this step's loads), the per-layer
hooks (free here), ``wait_for_save`` (this step's stores are deferred to the next step's
start so they never delay sampling), then ``get_finished`` / ``get_block_ids_with_load_errors``
/ ``build_connector_worker_meta``, which only poll: a load is reported in
``finished_recving`` only once its bytes are in the GPU blocks.

Copies run as device jobs of an `Engine` on a background loop (`ThreadedEngine`), through
`kvtier_async.transfer`'s handlers (CUDA streams and the event bridge on a GPU, worker
threads on CPU tensors). A job the engine could not take (its queue was full) comes back
deferred and is offered again at the next submission.

Flushes. ``jobs_to_flush`` names jobs whose GPU blocks this step's forward pass may
overwrite (their request was preempted or finished and vLLM handed the blocks on) or, after
a cache reset, every job in flight. ``handle_preemptions`` hands exactly those jobs to
`ThreadedEngine.flush`, wherever they are: this step's or last step's stores not submitted
yet, jobs deferred or still in the engine's inbox, queued or running ones. The flush submits
the ones without a place in a queue, waiting for room, and waits for them all, so nothing it
covers runs after the hook returns, whatever the queue depth. It waits ``wait_timeout_s`` at
most and never raises into vLLM: at the deadline the jobs that have not started are
cancelled and reported failed at once, and a warning names every abandoned job (job ids,
request ids, GPU blocks). A copy that is already running cannot be taken back: it is
cancelled too, but its failure is reported only when the copy really ended (a CPU copy's
thread returned; on CUDA, its end event completed), even though the hook returned before.
The scheduler frees a store's CPU slots when the failure reaches it
(``complete_store(success=False)``: nothing is cascaded), so no slot is handed to another
key while bytes may still land in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier_async._log import get_logger
from kvtier_async.engine import Deferred, Engine, Job, ThreadedEngine
from kvtier_async.ledger import JobKind
from kvtier_async.memory import SharedRegion, close_region
from kvtier_async.transfer.canonical import canonicalize
from kvtier_async.transfer.handlers import TransferRouter

from .config import ConnectorConfig
from .layout import OffloadLayout
from .metadata import DeviceJob, KVTierMetadata, KVTierWorkerMetadata
from .metrics import WorkerMetrics

__all__ = ["ConnectorWorker"]

log = get_logger(__name__)


class ConnectorWorker:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig) -> None:
        self.config = config
        self.layout = OffloadLayout.from_vllm(vllm_config, kv_cache_config, config)
        self._num_blocks = int(kv_cache_config.num_blocks)
        self._region: SharedRegion | None = None
        self._router: TransferRouter | None = None
        self._threaded: ThreadedEngine | None = None
        self._deferred_stores: dict[int, DeviceJob] = {}
        self._inflight: dict[int, tuple[int, DeviceJob]] = {}  # engine job id -> (ours, job)
        self._engine_jobs: dict[int, Job] = {}  # ours -> its engine job, while in flight
        self._retry: list[Job] = []
        self._meta = KVTierWorkerMetadata()
        self._recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._inline = False
        self.metrics = WorkerMetrics()  # this worker's copies, for vLLM's connector stats

    # --- set-up -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        layout = self.layout
        kv = canonicalize(
            kv_caches, [list(names) for names in layout.group_layers], num_blocks=self._num_blocks
        )
        slot_bytes = kv.slot_layout(layout.factor).slot_bytes
        if slot_bytes != layout.slot_bytes:
            raise ValueError(
                f"the KV caches need {slot_bytes} bytes per offloaded block, the "
                f"KV-cache config says {layout.slot_bytes}:\n{kv.describe()}"
            )
        self._region = SharedRegion(
            layout.instance_id,
            layout.num_slots,
            layout.slot_bytes,
            num_workers=layout.num_workers,
            worker_rank=layout.rank,
            directory=self.config.region_dir,
            wait_timeout_s=self.config.wait_timeout_s,
            role="worker",  # a place taken twice (another engine, the same id) is refused
            token=layout.token,
        )
        if kv.device.type == "cuda":
            self._region.register_cuda()
        router = TransferRouter.create(kv, self._region, block_size_factor=layout.factor)
        self._router = router
        mode = self.config.worker_copies
        self._inline = mode == "inline" or (mode == "auto" and kv.device.type == "cpu")
        if self._inline:
            log.info("kvtier connector worker ready (inline CPU copies)", rank=layout.rank)
            return

        async def run(job: Job) -> tuple[Sequence[bool], int]:
            device: DeviceJob = job.payload
            src, dst = (device.gpu, device.cpu) if device.is_store else (device.cpu, device.gpu)
            result = await router.transfer(src, dst)
            return (True,) * len(job.keys), result.bytes

        def make() -> Engine:
            return Engine(
                [], lambda slot: memoryview(b""), device=run, queue_depth=self.config.queue_depth
            )

        self._threaded = ThreadedEngine(make).__enter__()
        log.info(
            "kvtier connector worker ready",
            rank=layout.rank,
            slots=layout.num_slots,
            views=len(kv.views),
        )

    # --- per step ---------------------------------------------------------------------

    def handle_preemptions(self, meta: KVTierMetadata) -> None:
        """Flush the jobs the scheduler names (see the module docstring); submit last
        step's other stores."""
        flush = meta.jobs_to_flush
        for job_id in flush:
            job = meta.store_jobs.pop(job_id, None)
            if job is not None:
                self._deferred_stores[job_id] = job
        threaded = self._threaded
        if flush and threaded is not None:
            self._collect()  # what ended is not flushed again
            self._flush(threaded, flush)
        self._submit(self._deferred_stores)
        self._deferred_stores = {}

    def _flush(self, threaded: ThreadedEngine, flush: set[int]) -> None:
        deferred = self._deferred_stores
        for job_id in [j for j in deferred if j in flush]:
            self._engine_job(job_id, deferred.pop(job_id))
        in_flight = self._engine_jobs
        jobs = [in_flight[job_id] for job_id in flush if job_id in in_flight]
        if not jobs:
            return
        flushed = {job.job_id for job in jobs}
        self._retry = [job for job in self._retry if job.job_id not in flushed]
        abandoned = threaded.flush(jobs, self.config.wait_timeout_s)
        if abandoned:
            devices = [self._inflight[job.job_id] for job in abandoned]
            log.warning(
                "flush ran past its deadline: jobs abandoned (reported failed once ended)",
                job_ids=sorted(ours for ours, _ in devices),
                req_ids=sorted({device.req_id for _, device in devices}),
                gpu_blocks=sum(len(device.gpu.block_ids) for _, device in devices),
                timeout_s=self.config.wait_timeout_s,
            )

    def start_load_kv(self, meta: KVTierMetadata) -> None:
        """Submit last step's stores and this step's loads; the sync loads end before this
        returns (their requests run in this step's forward pass)."""
        self._submit(self._deferred_stores)
        self._deferred_stores = {}
        self._submit(meta.load_jobs)
        threaded = self._threaded
        if threaded is not None:
            sync = {job_id for job_id, job in meta.load_jobs.items() if job.sync}
            if sync:
                self._collect()
                self._flush(threaded, sync)

    def wait_for_save(self, meta: KVTierMetadata) -> None:
        """Defer this step's stores to the start of the next step."""
        self._deferred_stores.update(meta.store_jobs)

    def _submit(self, jobs: dict[int, DeviceJob]) -> None:
        if self._inline:
            for job_id, device in jobs.items():
                self._run_inline(job_id, device)
            return
        threaded = self._threaded
        if threaded is None or (not jobs and not self._retry):
            return
        batch, self._retry = self._retry, []
        for job_id, device in jobs.items():
            batch.append(self._engine_job(job_id, device))
        threaded.submit(batch)

    def _engine_job(self, job_id: int, device: DeviceJob) -> Job:
        kind = JobKind.STORE if device.is_store else JobKind.LOAD
        job = Job(kind, (b"",) * len(device.cpu), device)
        self._inflight[job.job_id] = (job_id, device)
        self._engine_jobs[job_id] = job
        return job

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose loads finished (their bytes are in place); never waits."""
        self._collect()
        recving, self._recving = self._recving, set()
        return None, recving or None

    def _collect(self) -> None:
        threaded = self._threaded
        if threaded is None:
            return
        for item in threaded.poll():
            if isinstance(item, Deferred):
                self._retry.append(item.job)
                continue
            job_id, device = self._inflight.pop(item.job_id)
            del self._engine_jobs[job_id]
            self._record(job_id, device, item.error, item.nbytes, item.run_s)

    def _run_inline(self, job_id: int, device: DeviceJob) -> None:
        """A copy between CPU tensors, done here: on a CPU device a thread hand-off buys no
        overlap and costs the scheduler the GIL."""
        assert self._router is not None
        src, dst = (device.gpu, device.cpu) if device.is_store else (device.cpu, device.gpu)
        error: Exception | None = None
        nbytes, seconds = 0, 0.0
        try:
            result = self._router.execute(src, dst)
            nbytes, seconds = result.bytes, result.seconds
        except Exception as exc:
            error = exc
        self._record(job_id, device, error, nbytes, seconds)

    def _record(
        self,
        job_id: int,
        device: DeviceJob,
        error: BaseException | None,
        nbytes: int = 0,
        seconds: float = 0.0,
    ) -> None:
        self._meta.completed[job_id] = self._meta.completed.get(job_id, 0) + 1
        if error is None:
            self.metrics.record(device.is_store, nbytes, seconds)
        else:
            self._meta.failed.add(job_id)
            log.warning(
                "device job failed", job_id=job_id, store=device.is_store, error=repr(error)
            )
        if not device.is_store:
            if not device.sync:  # a sync load's request runs already: nothing to report
                self._recving.add(device.req_id)
            if error is not None:
                self._load_errors.update(int(b) for b in device.gpu.block_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._collect()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KVTierWorkerMetadata | None:
        self._collect()
        meta = self._meta
        if not meta.completed:
            return None
        self._meta = KVTierWorkerMetadata()
        return meta

    def shutdown(self) -> None:
        if self._threaded is not None:
            self._threaded.close()
            self._threaded = None
        if self._router is not None:
            self._router.close()  # then dropped: it holds a tensor over the region
            self._router = None
        region, self._region = self._region, None
        if region is not None:
            close_region(region)
