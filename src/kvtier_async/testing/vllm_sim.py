"""vLLM 0.33's real scheduler and a fake model, on the CPU: a test bench for KV connectors.

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
import json
import pickle
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
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import copy_kv_blocks
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.forward_context import (
    get_forward_context,
    is_forward_context_available,
    set_forward_context,
)
from vllm.utils.hashing import sha256
from vllm.v1.attention.backend import AttentionMetadata
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache, copy_kv_cache_blocks_inplace

__all__ = [
    "TINY_LLAMA_CONFIG",
    "FakeAttentionMetadata",
    "FakeModel",
    "FakeOffloadingWorker",
    "HarnessStats",
    "KVMismatch",
    "KVPattern",
    "StepResult",
    "VllmHarness",
    "prefix_hashes",
    "write_model_dir",
]

# ../shared/vllm-cpu/tiny-llama-config.json, kept here so nothing outside the package is read.
TINY_LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# What a CUDA attention backend that states no layout preference reports
# (vllm/v1/attention/backends/utils.py: _DEFAULT_LAYOUT_PREFERENCE); the connector's
# get_required_kvcache_layout, when it has one, is then chosen among them.
_BACKEND_LAYOUTS = ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC"]
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_FIRST_SAMPLED_TOKEN = 3  # 0..2 are pad / bos / eos in the tiny config
Verify = Literal["full", "admission", "off"]
KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]


class KVMismatch(AssertionError):
    """A KV cache slot does not hold what the fake model wrote for that token."""


# --- deterministic K/V ---------------------------------------------------------------------

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_HASH_SEED = 0x5EED_0F_C0FFEE


def _mix64(x: int) -> int:
    """splitmix64's finalizer on a Python int."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def prefix_hashes(token_ids: Sequence[int], hashes: list[int] | None = None) -> list[int]:
    """``hashes[p]`` fingerprints ``token_ids[: p + 1]``; extends *hashes* in place if given."""
    out = [] if hashes is None else hashes
    h = out[-1] if out else _HASH_SEED
    for token in token_ids[len(out) :]:
        h = _mix64(h ^ (((token + 1) * _GOLDEN) & _M64))
        out.append(h)
    return out


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _mix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """The same finalizer on int64 tensors (wrapping multiplies, arithmetic shifts)."""
    x = (x ^ (x >> 30)) * _signed64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> 27)) * _signed64(0x94D049BB133111EB)
    return x ^ (x >> 31)


class KVPattern:
    """The K/V the fake model writes: for the token at position ``p`` of a sequence and layer
    ``l``, the ``[num_kv_heads, head_size + head_size_v]`` cell is a function of
    ``prefix_hashes(tokens)[p]`` and ``l`` only (so shared prefixes have equal KV, as in a real
    model). Element bits are pseudo-random with one exponent bit cleared: never NaN or Inf.
    """

    def __init__(self, num_kv_heads: int, head_size: int, head_size_v: int, dtype: torch.dtype):
        self.dtype = dtype
        self.cell = (num_kv_heads, head_size + head_size_v)
        self.width = torch.empty(0, dtype=dtype).element_size() * 8
        self.int_dtype = {8: torch.int8, 16: torch.int16, 32: torch.int32}[self.width]
        columns = num_kv_heads * (head_size + head_size_v)
        self._columns = torch.arange(columns, dtype=torch.int64)
        self._salts: dict[int, torch.Tensor] = {}

    def values(self, hashes: Sequence[int], layer: int) -> torch.Tensor:
        """The ``[len(hashes), num_kv_heads, head_size + head_size_v]`` cells, in ``dtype``."""
        salt = self._salts.get(layer)
        if salt is None:
            salt = _mix64_tensor(self._columns + (layer + 1) * (1 << 40))
            self._salts[layer] = salt
        h = torch.tensor([_signed64(v) for v in hashes], dtype=torch.int64)
        x = _mix64_tensor(h[:, None] ^ salt[None, :])
        low = x & ((1 << self.width) - 1) & ~(1 << (self.width - 2))
        signed = torch.where(low >= 1 << (self.width - 1), low - (1 << self.width), low)
        return signed.to(self.int_dtype).view(self.dtype).view(len(hashes), *self.cell)

    def next_token(self, last_hash: int, vocab_size: int) -> int:
        """The token the fake model samples after a prefix ending in *last_hash*."""
        span = vocab_size - _FIRST_SAMPLED_TOKEN
        return _FIRST_SAMPLED_TOKEN + _mix64(last_hash ^ _GOLDEN) % span


# --- the fake model runner -----------------------------------------------------------------


@dataclass
class FakeAttentionMetadata(AttentionMetadata):  # type: ignore[misc, unused-ignore]
    """What `FakeModel` passes as ``attn_metadata`` to ``save_kv_layer``: the step's batch in
    the shape of vLLM's common attention metadata (flat token order, request by request)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32: context + scheduled tokens
    num_actual_tokens: int
    req_ids: list[str]


@dataclass
class _ReqState:
    """What a model runner keeps per request: tokens (its own sampled ones included),
    block table per KV cache group, computed count."""

    prompt_len: int
    token_ids: list[int]
    block_ids: list[list[int]]
    num_computed_tokens: int
    hashes: list[int] = field(default_factory=list)
    # layer -> the K/V of the first len(hashes) tokens, grown by doubling
    kv: dict[int, torch.Tensor] = field(default_factory=dict)
    kv_len: dict[int, int] = field(default_factory=dict)

    def hashes_upto(self, end: int) -> list[int]:
        if len(self.hashes) < end:
            prefix_hashes(self.token_ids[:end], self.hashes)
        return self.hashes

    def expected(self, pattern: KVPattern, layer: int, begin: int, end: int) -> torch.Tensor:
        """The K/V of positions ``begin..end`` in *layer*, computed once per position."""
        have = self.kv_len.get(layer, 0)
        if have < end:
            values = pattern.values(self.hashes_upto(end)[have:end], layer)
            buffer = self.kv.get(layer)
            if buffer is None or buffer.shape[0] < end:
                grown = torch.empty((max(end, 2 * have), *pattern.cell), dtype=pattern.dtype)
                if buffer is not None:
                    grown[:have] = buffer[:have]
                self.kv[layer] = buffer = grown
            buffer[have:end] = values
            self.kv_len[layer] = end
        return self.kv[layer][begin:end]

    def reset(self, token_ids: Sequence[int]) -> None:
        self.token_ids = list(token_ids)
        self.hashes.clear()
        self.kv.clear()
        self.kv_len.clear()


@dataclass
class _Batch:
    req_ids: list[str]
    num_tokens: dict[str, int]
    admitted: set[str]


class FakeModel:
    """A V2-model-runner stand-in: request state from each `SchedulerOutput`, the KV writes
    and context reads of a forward pass, one sampled token per request, and the KV
    connector's worker hooks in ``vllm/v1/worker/gpu/model_runner.py``'s order:

    - no tokens scheduled (``ActiveKVConnector.no_forward``): ``handle_preemptions``,
      ``bind_connector_metadata``, ``finish_forward``, then the post-forward hooks below
      (``start_load_kv`` with no keyword arguments among them);
    - otherwise ``handle_preemptions``, ``bind_connector_metadata``, ``start_load_kv`` before
      the forward if ``has_sync_kv_loads``; per layer: write the layer's new K/V,
      ``wait_for_layer_load``, attention (the context check), ``save_kv_layer``; then
      ``finish_forward``; sampling; ``start_load_kv`` after the forward if it has not run;
      ``wait_for_save``, ``get_transfer_results(finished_req_ids)``,
      ``get_block_ids_with_load_errors``, ``get_kv_connector_stats``,
      ``get_kv_connector_kv_cache_events``, ``build_connector_worker_meta``,
      ``clear_connector_metadata``.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        kv_caches: Mapping[str, torch.Tensor],
        connector: KVConnectorBase_V1 | None,
        pattern: KVPattern,
        *,
        verify: Verify = "full",
        serialize: bool = True,
        report_delay_steps: int = 0,
    ) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.kv_caches = dict(kv_caches)
        self.connector = connector
        self.pattern = pattern
        self.verify: Verify = verify
        self.serialize = serialize
        self.block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.layers: list[tuple[str, int]] = [
            (name, group_id)
            for group_id, group in enumerate(kv_cache_config.kv_cache_groups)
            for name in group.layer_names
        ]
        self.layer_index = {name: i for i, (name, _) in enumerate(self.layers)}
        self.reqs: dict[str, _ReqState] = {}
        self.hook_log: list[str] | None = None  # set to [] to record hook names
        self._pending_load_kwargs: dict[str, Any] | None = None
        self._meta: Any = None
        self.report_delay_steps = report_delay_steps
        self.held_outputs: deque[KVConnectorOutput] = deque()  # held back, oldest first
        self.tokens_written = 0
        self.tokens_checked = 0

    # -- request state (finish_requests, add_requests, update_requests) --

    def _update_states(self, so: SchedulerOutput) -> set[str]:
        for req_id in so.finished_req_ids | (so.preempted_req_ids or set()):
            self.reqs.pop(req_id, None)
        admitted = set()
        for new in so.scheduled_new_reqs:
            tokens = new.prefill_token_ids
            if tokens is None:  # the V1 runner's NewRequestData: the prompt only
                tokens = new.prompt_token_ids
            assert tokens is not None
            self.reqs[new.req_id] = _ReqState(
                prompt_len=new.prompt_len,
                token_ids=list(tokens),
                block_ids=[list(ids) for ids in new.block_ids],
                num_computed_tokens=new.num_computed_tokens,
            )
            admitted.add(new.req_id)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.reqs[req_id]
            new_block_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # V1 runner only: the whole table again
                state.block_ids = [[] for _ in self.kv_cache_config.kv_cache_groups]
                if req_id in cached.all_token_ids:
                    state.reset(cached.all_token_ids[req_id])
                admitted.add(req_id)
            if new_block_ids is not None:
                for group_ids, added in zip(state.block_ids, new_block_ids, strict=True):
                    group_ids.extend(added)
            state.num_computed_tokens = cached.num_computed_tokens[i]
        if so.new_block_ids_to_zero:
            ids = torch.tensor(so.new_block_ids_to_zero, dtype=torch.int64)
            for cache in self.kv_caches.values():
                cache[ids] = 0
        if so.kv_cache_block_copies:
            copy_kv_cache_blocks_inplace(
                self.kv_caches.values(), self.kv_cache_config.num_blocks, so.kv_cache_block_copies
            )
        return admitted

    # -- one engine step --

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step as ``execute_model`` + ``sample_tokens`` do; return its output."""
        admitted = self._update_states(so)
        meta = so.kv_connector_metadata
        if self.serialize and meta is not None:
            meta = pickle.loads(pickle.dumps(meta))
        self._meta = meta
        active = self.connector is not None and meta is not None
        if so.total_num_scheduled_tokens == 0:  # ActiveKVConnector.no_forward
            if not active:
                return _empty_output()
            self._pre_forward(so, {})
            self._finish_forward()
            return ModelRunnerOutput.with_kv_conn_output_only(self._post_forward(so))

        batch = _Batch(list(so.num_scheduled_tokens), dict(so.num_scheduled_tokens), admitted)
        attn = self._attention_metadata(batch)
        if active:
            with set_forward_context({name: attn for name, _ in self.layers}, self.vllm_config):
                load_kwargs = {
                    "scheduler_output": so,
                    "request_state_indices": torch.arange(len(batch.req_ids)),
                    "request_ids": batch.req_ids,
                    "num_tokens": so.total_num_scheduled_tokens,
                }
                self._pre_forward(so, load_kwargs)
                self._forward(batch, attn)
            self._finish_forward()
        else:
            self._forward(batch, attn)
        sampled = self._sample(batch)
        kv_out = self._post_forward(so) if active else None
        return ModelRunnerOutput(
            req_ids=batch.req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(batch.req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_out,
        )

    def _forward(self, batch: _Batch, attn: FakeAttentionMetadata) -> None:
        for layer_name, group_id in self.layers:
            self._forward_layer(layer_name, group_id, batch, attn)

    def _finish_forward(self) -> None:
        assert self.connector is not None
        self._hook("finish_forward")
        self.connector.finish_forward()

    def _hook(self, name: str) -> None:
        if self.hook_log is not None:
            self.hook_log.append(name)

    def _pre_forward(self, so: SchedulerOutput, load_kwargs: dict[str, Any]) -> None:
        connector, meta = self.connector, self._meta
        assert connector is not None and meta is not None
        self._hook("handle_preemptions")
        connector.handle_preemptions(meta)
        self._hook("bind_connector_metadata")
        connector.bind_connector_metadata(meta)
        self._pending_load_kwargs = load_kwargs
        if so.has_sync_kv_loads:
            self._start_load_kv()

    def _start_load_kv(self) -> None:
        assert self.connector is not None and self._pending_load_kwargs is not None
        kwargs, self._pending_load_kwargs = self._pending_load_kwargs, None
        self._hook("start_load_kv")
        if is_forward_context_available():
            self.connector.start_load_kv(get_forward_context(), **kwargs)
        else:
            with set_forward_context(None, self.vllm_config):
                self.connector.start_load_kv(get_forward_context(), **kwargs)

    def _post_forward(self, so: SchedulerOutput) -> KVConnectorOutput:
        connector = self.connector
        assert connector is not None
        if self._pending_load_kwargs is not None:
            self._start_load_kv()
        out = KVConnectorOutput()
        self._hook("wait_for_save")
        untyped: Any = connector  # wait_for_save has no annotations
        untyped.wait_for_save()
        self._hook("get_transfer_results")
        results = connector.get_transfer_results(so.finished_req_ids)
        out.finished_sending = results.finished_sending or None
        out.finished_recving = results.finished_recving or None
        out.failed_recving = results.failed_recving
        self._hook("get_block_ids_with_load_errors")
        out.invalid_block_ids = connector.get_block_ids_with_load_errors()
        out.kv_connector_stats = connector.get_kv_connector_stats()
        out.kv_cache_events = connector.get_kv_connector_kv_cache_events()
        self._hook("build_connector_worker_meta")
        out.kv_connector_worker_meta = connector.build_connector_worker_meta()
        self._hook("clear_connector_metadata")
        connector.clear_connector_metadata()
        if self.report_delay_steps:
            self.held_outputs.append(out)
            if len(self.held_outputs) <= self.report_delay_steps:
                return KVConnectorOutput()
            out = self.held_outputs.popleft()
        if self.serialize:
            out = pickle.loads(pickle.dumps(out))
        return out

    def _attention_metadata(self, batch: _Batch) -> FakeAttentionMetadata:
        slots: list[int] = []
        starts = [0]
        seq_lens = []
        for req_id in batch.req_ids:
            state = self.reqs[req_id]
            begin = state.num_computed_tokens
            end = begin + batch.num_tokens[req_id]
            table = state.block_ids[0]
            slots += [
                table[p // self.block_size] * self.block_size + p % self.block_size
                for p in range(begin, end)
            ]
            starts.append(len(slots))
            seq_lens.append(end)
        return FakeAttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            num_actual_tokens=len(slots),
            req_ids=list(batch.req_ids),
        )

    def _forward_layer(
        self, layer_name: str, group_id: int, batch: _Batch, attn: FakeAttentionMetadata
    ) -> None:
        cache = self.kv_caches[layer_name]
        layer = self.layer_index[layer_name]
        # unified_kv_cache_update: this step's tokens' K/V go in before the layer's attention.
        for req_id in batch.req_ids:
            state = self.reqs[req_id]
            begin = state.num_computed_tokens
            end = begin + batch.num_tokens[req_id]
            if end > len(state.token_ids):
                raise AssertionError(
                    f"{req_id}: scheduled up to token {end} but the runner knows "
                    f"{len(state.token_ids)} tokens"
                )
            blocks, offsets = self._slots(state, group_id, begin, end, req_id)
            values = state.expected(self.pattern, layer, begin, end)
            cache[blocks, :, offsets, :] = values
            self.tokens_written += end - begin
        # unified_attention_with_output, wrapped by maybe_transfer_kv_layer.
        transfer = self.connector is not None and self.connector.has_connector_metadata()
        if transfer:
            assert self.connector is not None
            self._hook(f"wait_for_layer_load:{layer_name}")
            self.connector.wait_for_layer_load(layer_name)
        for req_id in batch.req_ids:
            if self.verify == "full" or (self.verify == "admission" and req_id in batch.admitted):
                state = self.reqs[req_id]
                self._check_range(req_id, state, group_id, layer_name, 0, state.num_computed_tokens)
        if transfer:
            assert self.connector is not None
            self._hook(f"save_kv_layer:{layer_name}")
            self.connector.save_kv_layer(layer_name, cache, attn)

    def _slots(
        self, state: _ReqState, group_id: int, begin: int, end: int, req_id: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        table = state.block_ids[group_id]
        positions = torch.arange(begin, end, dtype=torch.int64)
        index = positions // self.block_size
        if end > 0 and (end - 1) // self.block_size >= len(table):
            raise AssertionError(
                f"{req_id}: token {end - 1} has no block (the table has {len(table)})"
            )
        blocks = torch.tensor(table, dtype=torch.int64)[index]
        return blocks, positions % self.block_size

    def _check_range(
        self, req_id: str, state: _ReqState, group_id: int, layer_name: str, begin: int, end: int
    ) -> None:
        if end <= begin:
            return
        blocks, offsets = self._slots(state, group_id, begin, end, req_id)
        # Gather the touched blocks first: indexing a strided per-layer view token by token is
        # slow for layouts whose blocks are not [H, N, C]-contiguous.
        unique, inverse = torch.unique(blocks, return_inverse=True)
        got = self.kv_caches[layer_name].index_select(0, unique)[inverse, :, offsets, :]
        expected = state.expected(self.pattern, self.layer_index[layer_name], begin, end)
        int_dtype = self.pattern.int_dtype
        same = (got.view(int_dtype) == expected.view(int_dtype)).flatten(1).all(dim=1)
        self.tokens_checked += end - begin
        if not bool(same.all()):
            bad = begin + int((~same).nonzero()[0, 0])
            block = int(blocks[bad - begin])
            raise KVMismatch(
                f"{req_id}: {layer_name} token {bad} (block {block}, slot "
                f"{bad % self.block_size}, context {end} tokens) does not hold the KV the "
                f"model wrote for it"
            )

    def _sample(self, batch: _Batch) -> list[list[int]]:
        sampled: list[list[int]] = []
        for req_id in batch.req_ids:
            state = self.reqs[req_id]
            end = state.num_computed_tokens + batch.num_tokens[req_id]
            if end < len(state.token_ids):  # a prefill chunk: nothing sampled
                sampled.append([])
                continue
            token = self.pattern.next_token(state.hashes_upto(end)[end - 1], self.vocab_size)
            state.token_ids.append(token)
            sampled.append([token])
        return sampled


def _is_empty(out: KVConnectorOutput) -> bool:
    return not (
        out.finished_sending
        or out.finished_recving
        or out.invalid_block_ids
        or out.kv_connector_worker_meta is not None
    )


def _empty_output() -> ModelRunnerOutput:
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    output: ModelRunnerOutput = EMPTY_MODEL_RUNNER_OUTPUT
    return output


# --- a CPU stand-in for vLLM's CPUOffloadingWorker -----------------------------------------


@dataclass
class _Job:
    job_id: int
    is_store: bool
    # (tensor index, gpu rows, cpu chunks, block in chunk)
    pairs: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]
    ticks: int
    num_bytes: int
    copied: bool = False


class FakeOffloadingWorker(OffloadingWorker):  # type: ignore[misc, unused-ignore]
    """An `OffloadingWorker` for vLLM's `OffloadingConnector` on the CPU.

    Stores copy KV pages of GPU blocks to chunk slots of the CPU tier, loads copy them back:
    a private buffer, or given ``mmap_region`` (vLLM's `SharedOffloadRegion` of this worker,
    which vLLM's secondary tiers read and write) its rows as `CPUOffloadingWorker` lays them
    out. ``cpu[t]`` is tensor ``t``'s ``[num_chunks, blocks_per_chunk, page]`` view. With
    vLLM's addressing (``block_indices`` skips into the first chunk, one page per
    layer reference). Each direction completes in submission order, like a CUDA stream.
    A job submitted before the ``k``-th ``get_finished`` call is reported by call
    ``k + delay_steps`` (``0``: the same step's call), or by the next call once ``wait``
    covered it. With
    ``copy_at="complete"`` the bytes move when the job completes (the latest a real DMA could
    move them); with ``"submit"`` at submission.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        num_chunks: int,
        blocks_per_chunk: int,
        *,
        delay_steps: int = 1,
        copy_at: Literal["submit", "complete"] = "complete",
        mmap_region: Any = None,
    ) -> None:
        self.gpu = [t.tensor for t in kv_caches.tensors]
        self.refs = kv_caches.group_data_refs
        self.blocks_per_chunk = blocks_per_chunk
        self.mmap_region = mmap_region
        shape = (num_chunks, blocks_per_chunk)
        if mmap_region is None:
            self.cpu = [
                torch.zeros(*shape, t.page_size_bytes, dtype=torch.int8) for t in kv_caches.tensors
            ]
        else:
            self.cpu = [
                mmap_region.create_next_worker_view(blocks_per_chunk * t.page_size_bytes).view(
                    *shape, t.page_size_bytes
                )
                for t in kv_caches.tensors
            ]
        self.delay_steps = delay_steps
        self.copy_at = copy_at
        self.queues: dict[bool, deque[_Job]] = {True: deque(), False: deque()}
        self.submitted = {"store": 0, "load": 0}

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._submit(job_id, src_spec, dst_spec, is_store=True)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        return self._submit(job_id, dst_spec, src_spec, is_store=False)

    def _submit(
        self, job_id: int, gpu: GPULoadStoreSpec, cpu: LoadStoreSpec, *, is_store: bool
    ) -> bool:
        assert isinstance(cpu, BlockIDsLoadStoreSpec)
        pairs: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        num_bytes = 0
        gpu_offset = cpu_offset = 0
        bpc = self.blocks_per_chunk
        for group, (size, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices, strict=True)):
            if size == 0:
                continue
            skip = first % bpc
            num_chunks = -(-(size + skip) // bpc)
            gpu_rows = torch.as_tensor(
                gpu.block_ids[gpu_offset : gpu_offset + size], dtype=torch.int64
            )
            chunks = torch.as_tensor(
                cpu.block_ids[cpu_offset : cpu_offset + num_chunks], dtype=torch.int64
            )
            sub = (chunks[:, None] * bpc + torch.arange(bpc)[None, :]).flatten()[skip : skip + size]
            for ref in self.refs[group]:
                pairs.append((ref.tensor_idx, gpu_rows, sub // bpc, sub % bpc))
                num_bytes += size * ref.page_size_bytes
            gpu_offset += size
            cpu_offset += num_chunks
        assert gpu_offset == len(gpu.block_ids) and cpu_offset == len(cpu.block_ids)
        job = _Job(job_id, is_store, pairs, self.delay_steps, num_bytes)
        self.submitted["store" if is_store else "load"] += 1
        if self.copy_at == "submit":
            self._copy(job)
        self.queues[is_store].append(job)
        return True

    def _copy(self, job: _Job) -> None:
        if job.copied:
            return
        for tensor_idx, gpu_rows, chunks, blocks in job.pairs:
            gpu, cpu = self.gpu[tensor_idx], self.cpu[tensor_idx]
            if job.is_store:
                cpu[chunks, blocks] = gpu[gpu_rows]
            else:
                gpu[gpu_rows] = cpu[chunks, blocks]
        job.copied = True

    def get_finished(self) -> list[TransferResult]:
        results = []
        for queue in self.queues.values():
            while queue and queue[0].ticks <= 0:
                job = queue.popleft()
                started = time.perf_counter()
                self._copy(job)
                elapsed = time.perf_counter() - started
                results.append(TransferResult(job.job_id, True, job.num_bytes, elapsed))
            for job in queue:
                job.ticks -= 1
        return results

    def wait(self, job_ids: set[int]) -> None:
        for queue in self.queues.values():
            last = max((i for i, job in enumerate(queue) if job.job_id in job_ids), default=-1)
            for job in list(queue)[: last + 1]:
                self._copy(job)
                job.ticks = 0

    def pending(self) -> int:
        return sum(len(queue) for queue in self.queues.values())

    def shutdown(self) -> None:
        region, self.mmap_region = self.mmap_region, None
        if region is not None:
            self.cpu = []  # views of the region
            region.cleanup()


def _install_fake_offloading_worker(
    connector: KVConnectorBase_V1, delay_steps: int, copy_at: Literal["submit", "complete"]
) -> Callable[[], FakeOffloadingWorker | None]:
    """Make vLLM's OffloadingConnector (worker role) build a `FakeOffloadingWorker`."""
    connector_worker = getattr(connector, "connector_worker", None)
    if connector_worker is None:
        return lambda: None
    spec = connector_worker.spec
    made: list[FakeOffloadingWorker] = []

    def get_worker(kv_caches: CanonicalKVCaches) -> FakeOffloadingWorker:
        if not made:
            made.append(
                FakeOffloadingWorker(
                    kv_caches,
                    spec.num_chunks,
                    spec.blocks_per_chunk,
                    delay_steps=delay_steps,
                    copy_at=copy_at,
                    mmap_region=_worker_region(spec),
                )
            )
        return made[0]

    spec.get_worker = get_worker
    return lambda: made[0] if made else None


def _worker_region(spec: Any) -> Any:
    """The worker's `SharedOffloadRegion`, made as vLLM's ``create_worker`` makes it, for a
    spec whose tiers share it (``TieringOffloadingSpec``); None for a private buffer."""
    if not spec._uses_shared_region():
        return None
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    return SharedOffloadRegion(
        engine_id=spec._engine_id,
        num_chunks=spec.num_chunks,
        rank=0 if spec.replicated_layout else spec.config.parallel.rank,
        kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
        cpu_page_size=spec.cpu_page_size_per_worker,
    )


# --- the harness ---------------------------------------------------------------------------


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
        self.vllm_config = _vllm_config(
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
        worker_kv_cache_config, self.kv_cache_config, hash_block_size = _kv_cache_configs(
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
                self._fake_worker = _install_fake_offloading_worker(
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


# --- configuration -------------------------------------------------------------------------


def write_model_dir(
    path: str | Path,
    num_layers: int = 2,
    num_kv_heads: int = 2,
    head_size: int = 16,
    dtype: torch.dtype = torch.float16,
) -> Path:
    """Write the tiny Llama ``config.json`` with these KV shapes into *path*."""
    config = dict(TINY_LLAMA_CONFIG)
    num_heads = 2 * num_kv_heads
    config.update(
        num_hidden_layers=num_layers,
        num_key_value_heads=num_kv_heads,
        num_attention_heads=num_heads,
        hidden_size=num_heads * head_size,
        head_dim=head_size,
        torch_dtype=_DTYPE_NAMES[dtype],
    )
    if (num_layers, num_kv_heads, head_size) == (2, 2, 16):
        del config["head_dim"]  # exactly the shared file
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _vllm_config(
    *,
    model_dir: str,
    dtype: torch.dtype,
    block_size: int,
    num_gpu_blocks: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    enable_prefix_caching: bool,
    async_scheduling: bool,
    connector: str | None,
    connector_module_path: str | None,
    kv_role: KVRole,
    kv_load_failure_policy: Literal["recompute", "fail"],
    extra_config: dict[str, Any],
) -> VllmConfig:
    model_config = ModelConfig(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=0,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=async_scheduling,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
        num_gpu_blocks_override=num_gpu_blocks,
    )
    transfer = None
    if connector is not None:
        transfer = KVTransferConfig(
            kv_connector=connector,
            kv_connector_module_path=connector_module_path,
            kv_role=kv_role,
            kv_connector_extra_config=extra_config,
            kv_load_failure_policy=kv_load_failure_policy,
        )
    return VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=transfer,
    )


def _kv_cache_configs(
    vllm_config: VllmConfig, specs: dict[str, KVCacheSpec], num_gpu_blocks: int
) -> tuple[KVCacheConfig, KVCacheConfig, int]:
    """The worker's and the scheduler's KVCacheConfig, and the hash block size, as
    ``EngineCore._initialize_kv_caches`` derives them."""
    resolve_kv_cache_layout(vllm_config, [_BACKEND_LAYOUTS], list(specs.values()))
    groups = get_global_kv_cache_groups(vllm_config, [specs])
    page_bytes = sum(spec.page_size_bytes for spec in specs.values())
    (worker,) = get_kv_cache_configs(vllm_config, [specs], [page_bytes * num_gpu_blocks], groups)
    worker.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    scheduler = generate_scheduler_kv_cache_config([worker])
    vllm_config.cache_config.num_gpu_blocks = scheduler.num_blocks
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(scheduler, vllm_config)
    alignment = resolve_cache_hit_alignment_tokens(
        scheduler, vllm_config, scheduler_block_size, hash_block_size
    )
    for config in (worker, scheduler):
        config.hash_block_size = hash_block_size
        config.cache_hit_alignment_tokens = alignment
    vllm_config.cache_config.hash_block_size = hash_block_size
    vllm_config.cache_config.cache_hit_alignment_tokens = alignment
    return worker, scheduler, hash_block_size
