"""`VllmHarness`: vLLM 0.33's real scheduler and a fake model, on the CPU.

`VllmHarness` builds what vLLM's engine core builds, through vLLM's own functions:

- the `VllmConfig` (a tiny Llama config written to a temporary directory, no download), the
  KV cache layout resolved as ``resolve_kv_cache_layout`` resolves it for a CUDA attention
  backend that states no preference (so the connector's ``get_required_kvcache_layout`` wins),
  the `KVCacheConfig` from ``get_kv_cache_configs`` (one `FullAttentionSpec` group), and
  vLLM's real v1 `Scheduler` (`AsyncScheduler` with ``async_scheduling=True``). The connector
  is named by ``kv_connector`` / ``kv_connector_module_path`` and loaded by vLLM's
  `KVConnectorFactory`, never imported here.
- the worker: the same connector class in the ``WORKER`` role (a deep copy of the config, as
  a worker process holds), KV caches allocated by vLLM's ``allocate_kv_cache`` on the CPU (one
  flat int8 buffer, one ``[num_blocks, num_kv_heads, block_size, head_size + head_size_v]``
  view per layer), ``register_kv_caches`` and ``set_host_xfer_buffer_ops``, and `FakeModel`,
  which drives the connector's worker hooks in the V2 model runner's order (see
  `FakeModel.execute`).

The fake model writes, for every token it computes, K/V bytes that depend only on the token
sequence up to and including that token (`KVPattern`), so any block's content can be
recomputed. Its "attention" reads back the context of every scheduled request (positions
before ``num_computed_tokens``: prefix-cache hits and KV the connector loaded) and raises
`KVMismatch` on the first wrong byte. It never writes KV for tokens the scheduler counts as
computed. It samples one token per request from the prefix hash, so runs are repeatable.

vLLM's own `OffloadingConnector` refuses to create its worker without CUDA; for it the harness
swaps the spec's ``get_worker`` for `FakeOffloadingWorker`, which moves the bytes between the
KV caches and the CPU tier (a private buffer; with ``TieringOffloadingSpec`` the shared region
vLLM's secondary tiers read and write, as vLLM's `CPUOffloadingWorker` does) and reports each
job ``offload_delay_steps`` steps after it was submitted (at once when waited on), as
`OffloadingWorker` reports them.

Report delays, for comparing connectors. A connector whose worker finishes its copies when
it submits them (ours, with inline CPU copies) would report a job ``offload_delay_steps``
steps earlier than vLLM's over `FakeOffloadingWorker`, and its stores would become loadable
earlier. ``worker_report_delay_steps=k`` holds each step's `KVConnectorOutput` of the worker
connector back ``k`` steps (`FakeModel`), so both report every job ``k`` steps after the step
that submitted it: vLLM's decides a store in step N, its worker submits it at the start of
N+1 and reports it in N+2; with ``k = 1`` ours copies it at the start of N+1 and reports it
in N+2 too (loads likewise, one step after submission). A job that a flush waits for is the
exception: vLLM's reports it in the step of the flush, ours still ``k`` steps later.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import torch
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import copy_kv_blocks
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from .config import KVRole, build_vllm_config, kv_cache_configs, write_model_dir
from .model import FakeModel, Verify
from .offload_worker import FakeOffloadingWorker, install_fake_offloading_worker
from .pattern import KVMismatch, KVPattern, prefix_hashes

__all__ = ["HarnessStats", "StepResult", "VllmHarness"]


@dataclass
class StepResult:
    """One engine step: what was scheduled and, when processed, the model's output.

    ``sched_seconds`` is the time spent in ``schedule()`` and ``update_from_output()`` only.
    With async scheduling a step schedules one batch and may process an earlier one:
    ``processed`` is the `SchedulerOutput` whose output ``update_from_output`` took.
    """

    scheduled: SchedulerOutput | None
    output: ModelRunnerOutput | None
    processed: SchedulerOutput | None
    sched_seconds: float


@dataclass
class HarnessStats:
    steps: int = 0  # schedule() calls
    sched_seconds: float = 0.0  # in schedule() + update_from_output()
    step_seconds: list[float] = field(default_factory=list)  # the same, per step() call
    scheduled_tokens: int = 0  # tokens the model computed
    local_hit_tokens: int = 0  # GPU prefix-cache hits (first admission + after preemption)
    external_hit_tokens: int = 0  # connector hits (first admission + after preemption)
    external_hit_tokens_preempted: int = 0  # of which after a preemption
    external_queries: int = 0
    preemptions: int = 0
    finished: int = 0
    outputs: dict[str, list[int]] = field(default_factory=dict)  # sampled tokens per request

    @property
    def mean_step_seconds(self) -> float:
        return self.sched_seconds / self.steps if self.steps else 0.0


class VllmHarness:
    """vLLM 0.33's scheduler with a connector loaded by name, and `FakeModel` as its worker.

    ``connector`` is the ``kv_connector`` name (``None``: no KV transfer at all) and
    ``connector_module_path`` its ``kv_connector_module_path`` (``None`` for vLLM's registered
    connectors). ``extra_config`` is ``kv_connector_extra_config``. ``verify`` is how much
    context the fake attention checks: every step (``"full"``), when a request is admitted or
    resumed (``"admission"``: where prefix-cache hits and loads land), or never.
    ``offload_delay_steps`` / ``offload_copy_at`` configure `FakeOffloadingWorker` (vLLM's
    OffloadingConnector only); ``worker_report_delay_steps`` holds the worker connector's
    outputs back that many steps (see "Report delays" in the module docstring).
    ``serialize`` pickles what crosses between the roles (the connector metadata to the
    worker, the `KVConnectorOutput` back), as a multi-process executor does, so the roles
    share no objects. Use as a context manager, or call `close`.
    """

    def __init__(
        self,
        *,
        connector: str | None = None,
        connector_module_path: str | None = None,
        extra_config: Mapping[str, Any] | None = None,
        num_gpu_blocks: int = 256,
        block_size: int = 16,
        num_layers: int = 2,
        num_kv_heads: int = 2,
        head_size: int = 16,
        dtype: torch.dtype = torch.float16,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 32,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        async_scheduling: bool = False,
        kv_role: KVRole = "kv_both",
        kv_load_failure_policy: Literal["recompute", "fail"] = "fail",
        verify: Verify = "full",
        offload_delay_steps: int = 1,
        offload_copy_at: Literal["submit", "complete"] = "complete",
        worker_report_delay_steps: int = 0,
        serialize: bool = True,
        model_dir: str | Path | None = None,
    ) -> None:
        self._remove_tmp: Callable[[], Any] = lambda: None
        if model_dir is None:
            tmp = tempfile.mkdtemp(prefix="kvtier-vllm-model-")
            # Removed by close(), or when the harness is collected (also if __init__ fails).
            self._remove_tmp = weakref.finalize(self, shutil.rmtree, tmp, ignore_errors=True)
            model_dir = write_model_dir(tmp, num_layers, num_kv_heads, head_size, dtype)
        if max_model_len is None:
            max_model_len = min(4096, (num_gpu_blocks - 1) * block_size)
        self.block_size = block_size
        self.async_scheduling = async_scheduling
        self.vllm_config = build_vllm_config(
            model_dir=str(model_dir),
            dtype=dtype,
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            async_scheduling=async_scheduling,
            connector=connector,
            connector_module_path=connector_module_path,
            kv_role=kv_role,
            kv_load_failure_policy=kv_load_failure_policy,
            extra_config=dict(extra_config or {}),
        )
        specs: dict[str, KVCacheSpec] = {
            f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
                block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype
            )
            for i in range(num_layers)
        }
        worker_kv_cache_config, self.kv_cache_config, hash_block_size = kv_cache_configs(
            self.vllm_config, specs, num_gpu_blocks
        )
        self.layout = self.vllm_config.cache_config.kv_cache_layout
        self.pattern = KVPattern(num_kv_heads, head_size, head_size, dtype)

        # The worker first, as in the engine core (initialize_from_config, then the scheduler).
        self.worker_config = copy.deepcopy(self.vllm_config)
        self.worker_connector: KVConnectorBase_V1 | None = None
        self._fake_worker: Callable[[], FakeOffloadingWorker | None] = lambda: None
        if self.vllm_config.kv_transfer_config is not None:
            self.worker_connector = KVConnectorFactory.create_connector(
                config=self.worker_config,
                role=KVConnectorRole.WORKER,
                kv_cache_config=worker_kv_cache_config,
            )
            if isinstance(self.worker_connector, OffloadingConnector):
                self._fake_worker = install_fake_offloading_worker(
                    self.worker_connector, offload_delay_steps, offload_copy_at
                )
        layout = self.worker_config.cache_config.get_resolved_kv_cache_layout()
        self.kv_caches: dict[str, torch.Tensor] = allocate_kv_cache(
            worker_kv_cache_config, torch.device("cpu"), layout
        )
        if self.worker_connector is not None:
            self.worker_connector.register_kv_caches(self.kv_caches)
            self.worker_connector.set_host_xfer_buffer_ops(copy_kv_blocks)
        self.model = FakeModel(
            self.worker_config,
            worker_kv_cache_config,
            self.kv_caches,
            self.worker_connector,
            self.pattern,
            verify=verify,
            serialize=serialize,
            report_delay_steps=worker_report_delay_steps,
        )

        scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
        self.scheduler: Scheduler = scheduler_cls(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=self.vllm_config.cache_config.block_size,
            hash_block_size=hash_block_size,
            log_stats=True,
        )
        init_none_hash(sha256)
        self._block_hasher = get_request_block_hasher(hash_block_size, sha256)
        self.requests: dict[str, Request] = {}
        self.stats = HarnessStats()
        self._queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()

    # -- lifecycle --

    def __enter__(self) -> VllmHarness:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Shut both connector roles down and remove the temporary model directory."""
        try:
            self.scheduler.shutdown()
            worker_connector: Any = self.worker_connector  # shutdown has no annotations
            if worker_connector is not None:
                worker_connector.shutdown()
        finally:
            self._remove_tmp()

    # -- properties --

    @property
    def connector(self) -> KVConnectorBase_V1 | None:
        """The scheduler-role connector vLLM created."""
        connector: KVConnectorBase_V1 | None = self.scheduler.connector
        return connector

    @property
    def fake_offloading_worker(self) -> FakeOffloadingWorker | None:
        """The `FakeOffloadingWorker` under vLLM's OffloadingConnector, if that is loaded."""
        return self._fake_worker()

    @property
    def num_gpu_blocks(self) -> int:
        return int(self.kv_cache_config.num_blocks)

    # -- requests and steps --

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int = 8,
        *,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> Request:
        """Add a request that samples exactly *max_tokens* tokens (EOS is ignored)."""
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            pooling_params=None,
            mm_features=None,
            block_hasher=self._block_hasher,
        )
        if kv_transfer_params is not None:
            request.kv_transfer_params = kv_transfer_params
        self.requests[req_id] = request
        self.scheduler.add_request(request)
        return request

    def has_work(self) -> bool:
        """Whether the engine core would step again."""
        return bool(self.scheduler.has_requests() or self._queue)

    def step(self) -> StepResult:
        """One engine-core step: ``step`` (sync) or ``step_with_batch_queue`` (async)."""
        result = self._step_async() if self.async_scheduling else self._step_sync()
        self.stats.sched_seconds += result.sched_seconds
        self.stats.step_seconds.append(result.sched_seconds)
        return result

    def _step_sync(self) -> StepResult:
        started = time.perf_counter()
        so = self.scheduler.schedule()
        scheduled = time.perf_counter()
        output = self.model.execute(so)
        executed = time.perf_counter()
        engine_outputs = self.scheduler.update_from_output(so, output)
        elapsed = (scheduled - started) + (time.perf_counter() - executed)
        self._account(so)
        self._collect(engine_outputs)
        return StepResult(so, output, so, elapsed)

    def _step_async(self) -> StepResult:
        elapsed = 0.0
        so: SchedulerOutput | None = None
        output: ModelRunnerOutput | None = None
        if self.scheduler.has_requests():
            started = time.perf_counter()
            so = self.scheduler.schedule()
            elapsed += time.perf_counter() - started
            output = self.model.execute(so)
            self._queue.appendleft((so, output))
            self._account(so)
            executed = so.total_num_scheduled_tokens > 0
            if len(self._queue) < 2 and (executed or self.scheduler.has_requests()):
                return StepResult(so, output, None, elapsed)
        if not self._queue:
            return StepResult(so, output, None, elapsed)
        done, done_output = self._queue.pop()
        started = time.perf_counter()
        engine_outputs = self.scheduler.update_from_output(done, done_output)
        update = time.perf_counter() - started
        self._collect(engine_outputs)
        return StepResult(so, output, done, elapsed + update)

    def _account(self, so: SchedulerOutput) -> None:
        stats = self.stats
        stats.steps += 1
        stats.scheduled_tokens += so.total_num_scheduled_tokens
        stats.preemptions += len(so.preempted_req_ids or ())

    def _collect(self, engine_outputs: Mapping[int, Any]) -> None:
        stats = self.stats
        for eco in engine_outputs.values():
            for out in eco.outputs:
                stats.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    stats.finished += 1
            sched_stats = eco.scheduler_stats
            if sched_stats is None:
                continue
            local = sched_stats.prefix_cache_stats
            if local is not None:
                stats.local_hit_tokens += local.hits + local.preempted_hits
            external = sched_stats.connector_prefix_cache_stats
            if external is not None:
                stats.external_hit_tokens += external.hits + external.preempted_hits
                stats.external_hit_tokens_preempted += external.preempted_hits
                stats.external_queries += external.queries + external.preempted_queries

    def run_until_done(self, max_steps: int = 100_000) -> int:
        """Step until the engine core would stop; return the number of steps."""
        steps = 0
        while self.has_work():
            if steps >= max_steps:
                raise AssertionError(
                    f"still busy after {max_steps} steps: {len(self.scheduler.requests)} "
                    f"requests, {self.scheduler.get_request_counts()} running/waiting"
                )
            self.step()
            steps += 1
        return steps

    def drive(
        self,
        arrivals: Iterable[tuple[str, Sequence[int], int]],
        per_step: int = 1,
        max_steps: int = 1_000_000,
    ) -> int:
        """Add *per_step* requests ``(req_id, prompt, max_tokens)`` before each step, then run
        until done; return the number of steps."""
        pending: Iterator[tuple[str, Sequence[int], int]] = iter(arrivals)
        steps = 0
        exhausted = False
        while not exhausted or self.has_work():
            for _ in range(per_step if not exhausted else 0):
                item = next(pending, None)
                if item is None:
                    exhausted = True
                    break
                self.add_request(*item)
            if self.has_work():
                self.step()
                steps += 1
            if steps > max_steps:
                raise AssertionError(f"still busy after {max_steps} steps")
        return steps

    # -- checks --

    def expected_kv(
        self, token_ids: Sequence[int], begin: int, end: int, layer: int
    ) -> torch.Tensor:
        """The ``[end - begin, num_kv_heads, head_size + head_size_v]`` K/V the fake model
        writes for positions ``begin..end`` of a sequence starting with *token_ids*."""
        return self.pattern.values(prefix_hashes(token_ids[:end])[begin:end], layer)

    def expected_block(
        self, req_id: str, block_index: int, layer: int, num_tokens: int | None = None
    ) -> torch.Tensor:
        """The ``[num_kv_heads, n, head_size + head_size_v]`` K/V of block *block_index* of a
        request: its first *num_tokens* tokens (default: the ones the scheduler counts as
        computed) that fall in the block."""
        request = self.requests[req_id]
        if num_tokens is None:
            num_tokens = request.num_computed_tokens
        begin = block_index * self.block_size
        end = min(begin + self.block_size, num_tokens)
        return self.expected_kv(request.all_token_ids, begin, end, layer).transpose(0, 1)

    def check_block(
        self, req_id: str, gpu_block_id: int, block_index: int, num_tokens: int | None = None
    ) -> None:
        """Raise `KVMismatch` unless GPU block *gpu_block_id* holds block *block_index* of the
        request (its tokens as in `expected_block`) in every layer."""
        int_dtype = self.pattern.int_dtype
        for layer, (name, _) in enumerate(self.model.layers):
            expected = self.expected_block(req_id, block_index, layer, num_tokens)
            got = self.kv_caches[name][gpu_block_id, :, : expected.shape[1], :]
            if not torch.equal(got.view(int_dtype), expected.view(int_dtype)):
                raise KVMismatch(
                    f"{req_id}: GPU block {gpu_block_id} does not hold block {block_index} "
                    f"in {name}"
                )

    def leaks(self) -> list[str]:
        """What the scheduler, its block pool and the model still hold (``[]``: nothing)."""
        s = self.scheduler
        problems = []
        if s.requests:
            problems.append(f"scheduler still tracks requests {sorted(s.requests)}")
        num_running, num_waiting = s.get_request_counts()
        if num_running or num_waiting:
            problems.append(f"{num_running} running and {num_waiting} waiting requests")
        if s.finished_recving_kv_req_ids:
            problems.append(f"finished_recving not consumed: {s.finished_recving_kv_req_ids}")
        pool = s.kv_cache_manager.block_pool
        free = pool.get_num_free_blocks()
        if free != pool.num_gpu_blocks - 1:
            problems.append(f"{pool.num_gpu_blocks - 1 - free} GPU blocks not returned to the pool")
        held = [b.block_id for b in pool.blocks if b.ref_cnt and not b.is_null]
        if held:
            problems.append(f"blocks with a reference: {held[:16]}")
        for manager in s.kv_cache_manager.coordinator.single_type_managers:
            if manager.req_to_blocks:
                problems.append(f"block tables left: {sorted(manager.req_to_blocks)}")
        if self.model.reqs:
            problems.append(f"model runner still holds {sorted(self.model.reqs)}")
        if self.connector is not None and self.connector.has_pending_push_work():
            problems.append("the scheduler connector reports pending work")
        fake = self.fake_offloading_worker
        if fake is not None and fake.pending():
            problems.append(f"{fake.pending()} offloading jobs not reported")
        unsent = sum(not _is_empty(out) for out in self.model.held_outputs)
        if unsent:
            problems.append(f"{unsent} worker outputs with reports held back")
        return problems

    def assert_no_leaks(self) -> None:
        problems = self.leaks()
        if problems:
            raise AssertionError("; ".join(problems))


def _is_empty(out: KVConnectorOutput) -> bool:
    return not (
        out.finished_sending
        or out.finished_recving
        or out.invalid_block_ids
        or out.kv_connector_worker_meta is not None
    )
