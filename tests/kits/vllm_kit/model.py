"""`FakeModel`: a V2-model-runner stand-in that drives a KV connector's worker hooks.

It keeps request state from each `SchedulerOutput`, writes the K/V of the tokens it computes
(`KVPattern`), checks the context its "attention" reads (raising `KVMismatch` on the first
wrong byte), samples one token per request, and calls the connector's worker hooks in the
order of ``vllm/v1/worker/gpu/model_runner.py`` (see `FakeModel`).
"""

from __future__ import annotations

import pickle
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.forward_context import (
    get_forward_context,
    is_forward_context_available,
    set_forward_context,
)
from vllm.v1.attention.backend import AttentionMetadata
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

from .pattern import KVMismatch, KVPattern, prefix_hashes

__all__ = ["FakeAttentionMetadata", "FakeModel", "Verify"]

Verify = Literal["full", "admission", "off"]


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


def _empty_output() -> ModelRunnerOutput:
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    output: ModelRunnerOutput = EMPTY_MODEL_RUNNER_OUTPUT
    return output
