"""The one config model: both faces share their common fields and defaults, every error names
the field's full path and what is allowed, and vLLM's own keys are accepted as vLLM writes
them."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvtier_async.config import ConfigError, ConfigModel, parse
from kvtier_async.integrations.vllm.config import ConnectorConfig
from kvtier_async.ledger.tiering import StorePolicy
from kvtier_async.settings import CacheConfig, CommonConfig
from kvtier_async.tiers.base import OpenTierConfig, TierConfig, register_tier, tier_config
from kvtier_async.tiers.fs import FsTierConfig

API = {"block_bytes": 4096, "num_slots": 8}
VLLM = {"cpu_bytes_to_use": 1 << 20}


def api(**change: Any) -> CacheConfig:
    return CacheConfig.from_dict({**API, **change})


def vllm(**change: Any) -> ConnectorConfig:
    return ConnectorConfig.from_extra_config({**VLLM, **change})


def test_both_faces_are_one_model_with_one_default_per_shared_field() -> None:
    shared = set(CommonConfig.model_fields)
    assert shared >= {"eviction_policy", "store_threshold", "store_policy", "secondary_tiers",
                      "instance_id", "region_dir", "queue_depth", "close_timeout_s"}  # fmt: skip
    assert issubclass(CacheConfig, CommonConfig) and issubclass(ConnectorConfig, CommonConfig)
    a, v = api(), vllm()
    for name in shared:
        assert getattr(a, name) == getattr(v, name), name
    # a face may add fields of its own, never redefine a shared one
    for face in (CacheConfig, ConnectorConfig):
        for name in shared:
            assert repr(face.model_fields[name]) == repr(CommonConfig.model_fields[name]), name


def test_values_are_typed_and_read_once() -> None:
    config = api(store_policy="request_level", cpu_bytes_to_use=None)
    assert config.store_policy is StorePolicy.REQUEST_LEVEL
    sized = CacheConfig.from_dict({"block_bytes": 4096, "cpu_bytes_to_use": 10 * 4096 + 1})
    assert sized.num_slots == 10
    tiers = api(secondary_tiers=[{"type": "fs", "root_dir": "/kv"}, {"type": "memory"}])
    fs, memory = tiers.secondary_tiers
    assert isinstance(fs, FsTierConfig) and fs.root_dir == "/kv" and fs.mode == 0o600
    assert (fs.name, memory.name) == ("fs[0]", "memory[1]")
    assert (fs.path, memory.path) == ("secondary_tiers[0]", "secondary_tiers[1]")
    in_vllm = vllm(secondary_tiers=[{"type": "fs", "root_dir": "/kv", "name": "disk"}])
    assert in_vllm.secondary_tiers[0].path == "kv_connector_extra_config.secondary_tiers[0]"
    assert in_vllm.secondary_tiers[0].name == "disk"
    assert api(store_threshold=0).store_threshold == vllm(store_threshold=0).store_threshold == 1
    with pytest.raises(ValueError, match="frozen"):
        config.queue_depth = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("change", "field", "message"),
    [
        ({"queue_depth": 0}, "queue_depth", "must be in [1, 1048576], got 0"),
        ({"queue_depth": "8"}, "queue_depth", "must be an integer, got '8'"),
        ({"queue_depth": True}, "queue_depth", "must be an integer, got True"),
        ({"close_timeout_s": float("nan")}, "close_timeout_s", "must be a finite number"),
        ({"store_policy": "all"}, "store_policy", "must be one of 'block_level' or"),
        ({"eviction_policy": "fifo"}, "eviction_policy", "must be one of ['adaptive', 'arc'"),
        ({"region_dir": ""}, "region_dir", "must be a non-empty string, got ''"),
        ({"colour": 1}, "colour", "unknown key; allowed: ["),
        ({"secondary_tiers": {}}, "secondary_tiers", "must be a list, got dict"),
        ({"secondary_tiers": [7]}, "secondary_tiers[0]", "must be a mapping (JSON object)"),
        ({"secondary_tiers": [{}]}, "secondary_tiers[0].type", "must be one of ['fs', 'memory'"),
        (
            {"secondary_tiers": [{"type": "memory"}, {"type": "fs"}]},
            "secondary_tiers[1].root_dir",
            "is required",
        ),
        (
            {"secondary_tiers": [{"type": "fs", "root_dir": "/kv", "fsync": 1}]},
            "secondary_tiers[0].fsync",
            "must be true or false, got 1",
        ),
        (
            {"secondary_tiers": [{"type": "fs", "root_dir": "/kv", "mode": "0777"}]},
            "secondary_tiers[0].mode",
            "must be a file mode",
        ),
        (
            {"secondary_tiers": [{"type": "obj", "store_config": {"bucket": "b", "x": 1}}]},
            "secondary_tiers[0].store_config.x",
            "unknown key; allowed: ['access_key', 'bucket'",
        ),
        (
            {"secondary_tiers": [{"type": "obj", "store_config": {"bucket": 3}}]},
            "secondary_tiers[0].store_config.bucket",
            "must be a string, got 3",
        ),
    ],
)
def test_an_error_names_the_path_and_what_is_allowed(
    change: dict[str, Any], field: str, message: str
) -> None:
    for face, prefix in ((api, ""), (vllm, "kv_connector_extra_config.")):
        with pytest.raises(ConfigError) as info:
            face(**change)
        assert info.value.field == prefix + field
        assert str(info.value) == f"{prefix}{field}: {info.value.message}"
        assert message in info.value.message, info.value.message


def test_each_face_checks_its_own_fields() -> None:
    with pytest.raises(ConfigError, match=r"^cpu_bytes_to_use: give exactly one"):
        CacheConfig.from_dict({"block_bytes": 4096})
    with pytest.raises(ConfigError, match=r"^cpu_bytes_to_use: give exactly one"):
        api(cpu_bytes_to_use=1 << 20)
    with pytest.raises(ConfigError, match=r"^cpu_bytes_to_use: must be >= block_bytes \(4096\)"):
        CacheConfig.from_dict({"block_bytes": 4096, "cpu_bytes_to_use": 100})
    with pytest.raises(ConfigError, match=r"^kv_connector_extra_config.cpu_bytes_to_use: is req"):
        ConnectorConfig.from_extra_config({})
    with pytest.raises(ConfigError, match=r"^kv_connector_extra_config\.worker_copies: must be"):
        vllm(worker_copies="sometimes")
    with pytest.raises(ConfigError, match=r"^kv_connector_extra_config.secondary_tiers: CPUOff"):
        vllm(spec_name="CPUOffloadingSpec", secondary_tiers=[{"type": "memory"}])
    with pytest.raises(ConfigError, match=r"^kv_connector_extra_config.device_workers: unknown"):
        ConnectorConfig.from_extra_config({**VLLM, "device_workers": 2})
    with pytest.raises(ConfigError, match=r"^config: must be a mapping"):
        parse(CacheConfig, [1, 2])


def test_vllms_own_keys_are_accepted_and_the_meaningless_ones_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvtier_async")
    config = vllm(block_size=16, offload_prompt_only=False, max_tracker_size=10,
                  blocks_per_chunk=4, canonical_layout=True, sync_load_budget_bytes=1)  # fmt: skip
    assert (config.block_size, config.offload_prompt_only, config.max_tracker_size) == (
        16,
        False,
        10,
    )
    (entry,) = [r.getMessage() for r in caplog.records if "ignoring vLLM" in r.getMessage()]
    assert "keys=['blocks_per_chunk', 'canonical_layout']" in entry
    # vLLM's cache_policy_module_path is the policy only where eviction_policy names none
    path = "kvtier_async.ledger.policies:LRUPolicy"
    assert vllm(cache_policy_module_path=path).eviction_policy == "lru"
    assert vllm(eviction_policy="custom", cache_policy_module_path=path).eviction_policy == path


def test_a_callers_tier_model_is_copied_not_changed() -> None:
    mine = tier_config({"type": "fs", "root_dir": "/kv", "name": "disk"}, "tiers[7]")
    first, second = api(secondary_tiers=[mine]), vllm(secondary_tiers=[{"type": "memory"}, mine])
    assert first.secondary_tiers[0].path == "secondary_tiers[0]"
    assert second.secondary_tiers[1].path == "kv_connector_extra_config.secondary_tiers[1]"
    assert first.secondary_tiers[0].model_dump() == mine.model_dump()
    assert mine.path == "tiers[7]"  # the caller's object, as the caller made it


def test_a_plugin_tier_kind_gets_its_own_model_or_an_open_one() -> None:
    class DiskConfig(TierConfig):
        type: str = "disk"
        depth: int = 1

    register_tier("disk", lambda *a: None, DiskConfig)  # type: ignore[arg-type,return-value]
    register_tier("open", lambda *a: None)  # type: ignore[arg-type,return-value]
    try:
        disk = tier_config({"type": "disk", "depth": 3}, "secondary_tiers[2]")
        assert isinstance(disk, DiskConfig) and disk.depth == 3 and disk.name == "disk[2]"
        with pytest.raises(ConfigError, match=r"^secondary_tiers\[2\]\.depth: must be an int"):
            tier_config({"type": "disk", "depth": "3"}, "secondary_tiers[2]")
        anything = tier_config({"type": "open", "colour": "red"}, "t[0]")
        assert isinstance(anything, OpenTierConfig) and anything.model_extra == {"colour": "red"}
        assert isinstance(api(secondary_tiers=[{"type": "disk"}]).secondary_tiers[0], DiskConfig)
    finally:
        from kvtier_async.tiers import base

        del base._FACTORIES["disk"], base._FACTORIES["open"]


def test_every_config_model_refuses_unknown_keys_and_loose_types() -> None:
    for model in (CommonConfig, CacheConfig, ConnectorConfig, FsTierConfig):
        assert issubclass(model, ConfigModel)
        assert model.model_config.get("extra") == "forbid"
        assert model.model_config.get("strict") is True
        assert model.model_config.get("frozen") is True
