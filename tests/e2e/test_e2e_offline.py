"""vLLM's offline ``LLM`` with our connector: real forward passes, real paged KV cache.

One engine per configuration (see `conftest`): the CPU tier alone (``CPUOffloadingSpec``,
with sync loads: ``sync_load_budget_bytes``),
the CPU tier and an fs tier, the CPU tier and an obj tier (moto on 127.0.0.1), the fs tier
under preemption, then a second engine process, vLLM's default multi-process engine, that
serves what the first ones stored in fs and in S3. Each runs the same steps:

- ``cold``: the prompts computed (nothing cached anywhere), stored by the connector;
- ``again``: the same prompts, served by vLLM's own prefix cache (no external hit);
- ``reset_prefix_cache()`` (vLLM's prefix cache only): served by our CPU tier;
- ``reset_prefix_cache(reset_connector=True)``: our CPU tier is cleared too; served by the
  secondary tier (promoted), or recomputed with the CPU tier alone.

Every step's greedy token ids equal the no-connector engine's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _e2e import BLOCK_BYTES, BLOCK_TOKENS, CACHED, PROMPTS, connector, delta, generate

pytestmark = pytest.mark.e2e

EXTERNAL = "vllm:external_prefix_cache_hits"
LOCAL = "vllm:prefix_cache_hits"
STORED = "vllm:kv_offload_store_bytes"
LOADED = "vllm:kv_offload_load_bytes"
STEPS = ("cold", "again", "cpu_tier", "after_connector_reset")


def scenario(extra_set: str | None = None) -> list[dict[str, Any]]:
    ops = [
        generate("P"),  # cold
        generate("P"),  # again: vLLM's prefix cache
        {"op": "reset", "connector": False},
        generate("P"),  # our CPU tier
        {"op": "reset", "connector": True},
        generate("P"),  # our secondary tier, or recomputed
    ]
    if extra_set is not None:
        ops.append(generate(extra_set))
    ops.append({"op": "settle", "timeout_s": 60})
    return ops


def generations(results: list[dict[str, Any]]) -> list[int]:
    return [i for i, r in enumerate(results) if r["op"] == "generate"]


@pytest.fixture(scope="module")
def cpu_run(engine: Any) -> dict[str, Any]:
    # Sync loads (vLLM 0.33's sync_load_budget_bytes): a hit loads within its step.
    config = connector({"spec_name": "CPUOffloadingSpec", "sync_load_budget_bytes": 64 << 20})
    return engine("cpu", scenario(), config)


@pytest.fixture(scope="module")
def fs_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fs-root")


@pytest.fixture(scope="module")
def fs_run(engine: Any, fs_root: Path) -> dict[str, Any]:
    config = connector({"secondary_tiers": [{"type": "fs", "root_dir": str(fs_root)}]})
    return engine("fs", scenario("F"), config)


@pytest.fixture(scope="module")
def obj_run(engine: Any, moto: Any, bucket: str, s3_env: dict[str, str]) -> dict[str, Any]:
    tier = {"type": "obj", "bucket": bucket, "endpoint_override": moto.endpoint}
    return engine("obj", scenario("O"), connector({"secondary_tiers": [tier]}), env=s3_env)


RUNS = ("cpu_run", "fs_run", "obj_run")


@pytest.mark.parametrize("run", RUNS)
def test_every_step_samples_what_the_engine_without_a_connector_samples(
    run: str, baseline: dict[str, list[list[int]]], request: pytest.FixtureRequest
) -> None:
    results = request.getfixturevalue(run)["results"]
    indices = generations(results)
    assert len(indices) >= 4
    for index in indices:
        step = STEPS[indices.index(index)] if indices.index(index) < 4 else "extra"
        name = results[index].get("name") or "P"
        expected = baseline["P" if step != "extra" else _extra(run)]
        assert results[index]["token_ids"] == expected, f"{run}: step {step} ({name})"


def _extra(run: str) -> str:
    return {"fs_run": "F", "obj_run": "O"}[run]


@pytest.mark.parametrize("run", RUNS)
def test_the_cold_run_is_computed_and_stored(run: str, request: pytest.FixtureRequest) -> None:
    results = request.getfixturevalue(run)["results"]
    cold = generations(results)[0]
    prompts = len(PROMPTS["P"][0])
    assert results[cold]["num_cached_tokens"] == [0] * prompts
    assert delta(results, cold, EXTERNAL) == 0
    # Every full block of every prompt reached the CPU tier (vLLM's own store counter).
    blocks = prompts * (CACHED // BLOCK_TOKENS)
    assert delta(results, cold, STORED) == blocks * BLOCK_BYTES


@pytest.mark.parametrize("run", RUNS)
def test_the_same_prompts_again_are_vllms_own_prefix_cache_hits(
    run: str, request: pytest.FixtureRequest
) -> None:
    results = request.getfixturevalue(run)["results"]
    again = generations(results)[1]
    prompts = len(PROMPTS["P"][0])
    assert results[again]["num_cached_tokens"] == [CACHED] * prompts
    assert delta(results, again, LOCAL) == prompts * CACHED
    assert delta(results, again, EXTERNAL) == 0
    assert delta(results, again, STORED) == 0  # held already: nothing stored twice


@pytest.mark.parametrize("run", RUNS)
def test_after_vllms_prefix_cache_is_reset_our_cpu_tier_serves_them(
    run: str, request: pytest.FixtureRequest
) -> None:
    results = request.getfixturevalue(run)["results"]
    served = generations(results)[2]
    prompts = len(PROMPTS["P"][0])
    assert results[served]["num_cached_tokens"] == [CACHED] * prompts
    assert delta(results, served, EXTERNAL) == prompts * CACHED
    assert delta(results, served, LOADED) == prompts * (CACHED // BLOCK_TOKENS) * BLOCK_BYTES


@pytest.mark.parametrize("run", ["fs_run", "obj_run"])
def test_after_the_connector_is_reset_the_secondary_tier_serves_them(
    run: str, request: pytest.FixtureRequest
) -> None:
    results = request.getfixturevalue(run)["results"]
    served = generations(results)[3]
    prompts = len(PROMPTS["P"][0])
    assert results[served]["num_cached_tokens"] == [CACHED] * prompts
    assert delta(results, served, EXTERNAL) == prompts * CACHED
    # Promoted, not stored again: the finished requests of before the reset were dropped
    # with it (as vLLM's connector drops them), so nothing went to the CPU tier again.
    assert delta(results, served, STORED) == 0


def test_with_the_cpu_tier_alone_a_connector_reset_loses_everything(
    cpu_run: dict[str, Any],
) -> None:
    results = cpu_run["results"]
    recomputed = generations(results)[3]
    assert results[recomputed]["num_cached_tokens"] == [0] * len(PROMPTS["P"][0])
    assert delta(results, recomputed, EXTERNAL) == 0


@pytest.mark.parametrize("run", RUNS)
def test_the_engine_settles(run: str, request: pytest.FixtureRequest) -> None:
    last = request.getfixturevalue(run)["results"][-1]
    assert last["op"] == "settle"
    assert last["settled"] is True


# --- preemption ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def preempt_run(engine: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Six requests of 800 tokens each in a KV cache of 15 blocks (1,920 tokens): vLLM
    preempts requests and resumes them."""
    root = tmp_path_factory.mktemp("fs-preempt")
    config = connector({"secondary_tiers": [{"type": "fs", "root_dir": str(root)}]})
    ops = [generate("Q"), {"op": "reset", "connector": False}, generate("Q")]
    return engine(
        "preempt", ops, config, num_gpu_blocks_override=16, max_model_len=1024, max_num_seqs=8
    )


def test_under_preemption_outputs_match_and_requests_are_resumed(
    preempt_run: dict[str, Any], baseline: dict[str, list[list[int]]]
) -> None:
    results = preempt_run["results"]
    cold, served = generations(results)
    assert delta(results, cold, "vllm:num_preemptions") > 0
    assert results[cold]["token_ids"] == baseline["Q"]
    assert results[served]["token_ids"] == baseline["Q"]
    assert results[served]["num_cached_tokens"] == [CACHED] * len(PROMPTS["Q"][0])
    assert delta(results, served, EXTERNAL) >= len(PROMPTS["Q"][0]) * CACHED


# --- a second engine process ------------------------------------------------------------


@pytest.fixture(scope="module")
def second_run(
    engine: Any,
    fs_run: dict[str, Any],
    obj_run: dict[str, Any],
    fs_root: Path,
    moto: Any,
    bucket: str,
    s3_env: dict[str, str],
) -> dict[str, Any]:
    """vLLM's default multi-process engine (EngineCore in its own process) over the fs root
    and the bucket the first engines left: F was stored in fs only, O in S3 only."""
    tiers = [
        {"type": "fs", "root_dir": str(fs_root)},
        {"type": "obj", "bucket": bucket, "endpoint_override": moto.endpoint},
    ]
    ops = [generate("F"), generate("O")]
    return engine(
        "second", ops, connector({"secondary_tiers": tiers}), multiprocess=True, env=s3_env
    )


@pytest.mark.parametrize(("index", "name"), [(0, "F"), (1, "O")])
def test_a_second_engine_process_serves_what_the_first_stored(
    second_run: dict[str, Any], baseline: dict[str, list[list[int]]], index: int, name: str
) -> None:
    results = second_run["results"]
    prompts = len(PROMPTS[name][0])
    assert results[index]["token_ids"] == baseline[name]
    assert results[index]["num_cached_tokens"] == [CACHED] * prompts
    assert delta(results, index, EXTERNAL) == prompts * CACHED


# --- tensor parallelism -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tp_run(engine: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two workers (``tensor_parallel_size=2``, one core each) writing their rows of one
    shared region, interleaved; the scheduler's tier reads both rows of a slot."""
    root = tmp_path_factory.mktemp("fs-tp")
    tiers = [{"type": "fs", "root_dir": str(root)}]
    config = connector({"secondary_tiers": tiers, "sync_load_budget_bytes": 64 << 20})
    ops = [
        generate("P"),  # cold
        {"op": "reset", "connector": False},
        generate("P"),  # our CPU tier: each worker loads its own rows
        {"op": "reset", "connector": True},
        generate("P"),  # the fs tier: a block's file holds both workers' rows
    ]
    return engine("tp2", ops, config, multiprocess=True, tensor_parallel_size=2)


def test_two_workers_share_one_region_and_sample_what_they_computed(
    tp_run: dict[str, Any],
) -> None:
    results = tp_run["results"]
    cold, cpu_tier, fs_tier = generations(results)
    prompts = len(PROMPTS["P"][0])
    for served in (cpu_tier, fs_tier):
        assert results[served]["token_ids"] == results[cold]["token_ids"]
        assert results[served]["num_cached_tokens"] == [CACHED] * prompts
        assert delta(results, served, EXTERNAL) == prompts * CACHED
    # Each worker copies its own half of every block: vLLM sums the two workers' bytes.
    assert delta(results, cold, STORED) == prompts * (CACHED // BLOCK_TOKENS) * BLOCK_BYTES
