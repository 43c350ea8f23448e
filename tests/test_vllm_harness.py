"""The vLLM harness: vLLM 0.33's real scheduler with a connector loaded by name, the fake
model's K/V writes and checks, preemption, async scheduling and leak accounting. Run with no
connector and with vLLM's own OffloadingConnector over `FakeOffloadingWorker`; the same checks
then apply to ours."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

import vllm_harness as vh
from vllm_harness import VLLM_OFFLOADING, cpu_offloading, random_tokens, shared_prefix_requests

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", autouse=True)
def _vllm() -> None:
    """Skip without vLLM; import it here, not at collection, so that a run deselecting the
    ``vllm`` marker does not pay for the import (seconds)."""
    pytest.importorskip("vllm")
    vh.load()


SHARED_CONFIG = (
    Path(__file__).resolve().parents[2] / "shared" / "vllm-cpu" / "tiny-llama-config.json"
)
# 40 requests over 4 shared documents, 2 arriving per step, on 48 GPU blocks of 16 tokens:
# the GPU prefix cache evicts and the scheduler preempts.
TRACE = shared_prefix_requests(seed=7, num_requests=40)
SMALL_GPU: dict[str, Any] = {"num_gpu_blocks": 48, "max_num_batched_tokens": 256}
LAYER0 = "model.layers.0.self_attn.attn"
LAYER1 = "model.layers.1.self_attn.attn"
POST_FORWARD = [
    "wait_for_save",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
    "clear_connector_metadata",
]
LAYERS = [
    f"wait_for_layer_load:{LAYER0}",
    f"save_kv_layer:{LAYER0}",
    f"wait_for_layer_load:{LAYER1}",
    f"save_kv_layer:{LAYER1}",
]


def run_trace(**kwargs: Any) -> Any:
    harness = vh.VllmHarness(**SMALL_GPU, **kwargs)
    harness.drive(TRACE, per_step=2)
    return harness


@pytest.fixture(scope="module")
def baseline() -> dict[str, list[int]]:
    """Sampled tokens of every request of `TRACE`, with no connector."""
    with run_trace() as harness:
        harness.assert_no_leaks()
        return harness.stats.outputs


def test_tiny_config_is_the_shared_one(tmp_path: Path) -> None:
    config = json.loads((vh.write_model_dir(tmp_path) / "config.json").read_text())
    assert config == vh.TINY_LLAMA_CONFIG
    if SHARED_CONFIG.exists():
        assert json.loads(SHARED_CONFIG.read_text()) == vh.TINY_LLAMA_CONFIG


@pytest.mark.parametrize(
    ("kwargs", "layout"),
    [({}, "LBNHC"), (VLLM_OFFLOADING, "LBHNC")],
    ids=["no-connector", "vllm-offloading"],
)
def test_kv_caches_are_allocated_as_vllm_allocates(kwargs: dict[str, Any], layout: str) -> None:
    """One int8 buffer, one [blocks, kv heads, block size, K|V] view per layer, in the layout
    vLLM resolves (the connector's required one, when it states one)."""
    with vh.VllmHarness(num_gpu_blocks=32, **kwargs) as h:
        assert h.layout == layout
        assert list(h.kv_caches) == [LAYER0, LAYER1]
        views = list(h.kv_caches.values())
        for view in views:
            assert view.shape == (32, 2, 16, 32)
            assert view.dtype == torch.float16
        assert views[0].untyped_storage().data_ptr() == views[1].untyped_storage().data_ptr()
        assert h.connector is None if not kwargs else h.connector is not None
        assert (h.worker_connector is None) == (not kwargs)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("kwargs", [{}, VLLM_OFFLOADING], ids=["no-connector", "vllm-offloading"])
def test_trace_completes_without_leaks(
    baseline: dict[str, list[int]], kwargs: dict[str, Any], async_scheduling: bool
) -> None:
    """Every request samples exactly max_tokens tokens, the same ones whatever the connector or
    scheduling mode (KV from caches and loads is checked byte for byte on the way), the
    scheduler preempts, and nothing is left over."""
    with run_trace(async_scheduling=async_scheduling, **kwargs) as h:
        h.assert_no_leaks()
        assert h.stats.outputs == baseline
        assert {req_id: len(tokens) for req_id, tokens in h.stats.outputs.items()} == {
            req_id: max_tokens for req_id, _, max_tokens in TRACE
        }
        assert h.stats.finished == len(TRACE)
        assert h.stats.preemptions > 0
        assert h.stats.local_hit_tokens > 0
        assert h.model.tokens_checked > 0
        if kwargs:
            assert h.stats.external_hit_tokens > 0
            fake = h.fake_offloading_worker
            assert fake is not None
            assert fake.submitted["store"] > 0 and fake.submitted["load"] > 0


def evict_gpu_prefix_cache(h: Any, seed: int = 1) -> None:
    """Run unrelated requests until every GPU block has been reallocated."""
    rng = random.Random(seed)
    prompt_blocks = 8
    for i in range(-(-h.num_gpu_blocks // prompt_blocks) + 1):
        h.add_request(f"filler-{i}", random_tokens(rng, prompt_blocks * 16 + 3), max_tokens=2)
        h.run_until_done()


def test_vllm_offloading_gives_external_hits() -> None:
    """A request sharing a prefix with one that finished, after the GPU prefix cache lost it,
    loads the prefix from vLLM's CPU tier, and the loaded bytes are the ones the model wrote."""
    rng = random.Random(0)
    prefix = random_tokens(rng, 100)
    with vh.VllmHarness(num_gpu_blocks=40, **VLLM_OFFLOADING) as h:
        h.add_request("first", [*prefix, 5, 6, 7], max_tokens=4)
        h.run_until_done()
        assert h.stats.external_hit_tokens == 0
        evict_gpu_prefix_cache(h)
        checked = h.model.tokens_checked
        h.add_request("second", [*prefix, 9, 9, 9, 9], max_tokens=4)
        h.run_until_done()
        # 6 full blocks in the shared prefix: all come back, from the CPU tier.
        assert h.stats.external_hit_tokens == 96
        assert h.model.tokens_checked - checked >= 96 * 2
        h.assert_no_leaks()


def test_corrupted_offloaded_copy_is_caught() -> None:
    rng = random.Random(0)
    prefix = random_tokens(rng, 64)
    with vh.VllmHarness(num_gpu_blocks=40, **VLLM_OFFLOADING) as h:
        h.add_request("first", [*prefix, 5], max_tokens=2)
        h.run_until_done()
        evict_gpu_prefix_cache(h)
        fake = h.fake_offloading_worker
        assert fake is not None
        for buffer in fake.cpu:
            buffer.bitwise_not_()
        h.add_request("second", [*prefix, 9], max_tokens=2)
        with pytest.raises(vh.KVMismatch, match="second"):
            h.run_until_done()


def test_corrupted_gpu_block_is_caught() -> None:
    rng = random.Random(0)
    with vh.VllmHarness(num_gpu_blocks=32) as h:
        h.add_request("a", random_tokens(rng, 40), max_tokens=8)
        h.step()  # the prefill
        block = h.scheduler.kv_cache_manager.get_block_ids("a")[0][1]
        h.check_block("a", block, 1)
        with pytest.raises(vh.KVMismatch, match="GPU block"):
            h.check_block("a", block, 0)
        h.kv_caches[LAYER1].view(torch.int16)[block, 1, 3, 0] ^= 1
        with pytest.raises(vh.KVMismatch, match=f"a: {LAYER1} token 19"):
            h.step()


def test_blocks_hold_the_model_kv() -> None:
    rng = random.Random(0)
    with vh.VllmHarness(num_gpu_blocks=32) as h:
        h.add_request("a", random_tokens(rng, 37), max_tokens=20)
        for _ in range(10):
            h.step()
        tokens = h.requests["a"].all_token_ids
        assert len(tokens) == 47
        blocks = h.scheduler.kv_cache_manager.get_block_ids("a")[0]
        assert len(blocks) == 3
        for index, block in enumerate(blocks):
            h.check_block("a", block, index)
        partial = h.expected_block("a", 2, 0)
        assert partial.shape == (2, 46 - 32, 32)  # token 46 is sampled, not yet computed
        assert h.expected_block("a", 2, 0, num_tokens=47).shape == (2, 47 - 32, 32)
        torch.testing.assert_close(
            h.kv_caches[LAYER0][blocks[2], :, : partial.shape[1], :], partial, rtol=0, atol=0
        )
        h.run_until_done()
        h.assert_no_leaks()


def test_hook_order_is_the_v2_model_runners() -> None:
    """vllm/v1/worker/gpu/model_runner.py + kv_connector.py: per step, with no synchronous
    load, start_load_kv runs after the forward; with one, before it; a step with no tokens
    (only requests waiting for their KV) runs the hooks with no forward."""
    rng = random.Random(0)
    prefix = random_tokens(rng, 64)
    extra = cpu_offloading(sync_load_budget_bytes=1 << 30)
    with vh.VllmHarness(
        num_gpu_blocks=40,
        offload_delay_steps=2,
        connector="OffloadingConnector",
        extra_config=extra,
    ) as h:
        h.model.hook_log = []
        h.add_request("first", [*prefix, 5], max_tokens=2)
        h.step()
        assert h.model.hook_log == [
            "handle_preemptions",
            "bind_connector_metadata",
            *LAYERS,
            "finish_forward",
            "start_load_kv",
            *POST_FORWARD,
        ]
        h.run_until_done()
        evict_gpu_prefix_cache(h)
        h.model.hook_log = []
        h.add_request("second", [*prefix, 9], max_tokens=2)
        result = h.step()
        assert result.scheduled is not None and result.scheduled.has_sync_kv_loads
        assert h.model.hook_log == [
            "handle_preemptions",
            "bind_connector_metadata",
            "start_load_kv",
            *LAYERS,
            "finish_forward",
            *POST_FORWARD,
        ]
        h.run_until_done()
        h.assert_no_leaks()


def test_async_load_holds_the_request_until_finished_recving() -> None:
    rng = random.Random(0)
    prefix = random_tokens(rng, 64)
    with vh.VllmHarness(num_gpu_blocks=40, offload_delay_steps=3, **VLLM_OFFLOADING) as h:
        h.add_request("first", [*prefix, 5], max_tokens=2)
        h.run_until_done()
        evict_gpu_prefix_cache(h)
        second = h.add_request("second", [*prefix, 9], max_tokens=2)
        h.model.hook_log = []
        result = h.step()
        assert second.status.name == "WAITING_FOR_REMOTE_KVS"
        assert second.num_computed_tokens == 64
        assert result.scheduled is not None
        assert result.scheduled.total_num_scheduled_tokens == 0
        # No forward: the hooks run around no model at all.
        assert h.model.hook_log == [
            "handle_preemptions",
            "bind_connector_metadata",
            "finish_forward",
            "start_load_kv",
            *POST_FORWARD,
        ]
        waited = 1
        while second.status.name == "WAITING_FOR_REMOTE_KVS":
            h.step()
            waited += 1
        assert waited >= 3
        h.run_until_done()
        assert h.stats.external_hit_tokens == 64
        h.assert_no_leaks()


def test_vllm_tiering_promotes_from_its_fs_tier(tmp_path: Path) -> None:
    """vLLM's TieringOffloadingSpec with its own fs tier: FakeOffloadingWorker writes the
    shared region the tier cascades from, so a prefix the CPU tier evicted comes back from
    the files, byte for byte."""
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8 * 4096,  # 8 blocks: the fillers push the prefix out
        "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "kv")}],
    }
    prefix = random_tokens(random.Random(5), 100)
    with vh.VllmHarness(
        num_gpu_blocks=40, connector="OffloadingConnector", extra_config=extra
    ) as h:
        h.add_request("first", [*prefix, 5], max_tokens=2)
        h.run_until_done()
        evict_gpu_prefix_cache(h)
        checked = h.model.tokens_checked
        h.add_request("second", [*prefix, 6], max_tokens=2)
        h.run_until_done()
        assert h.stats.external_hit_tokens == 96
        assert h.model.tokens_checked - checked >= 96 * 2
        h.assert_no_leaks()
    assert any((tmp_path / "kv").rglob("*.bin"))
