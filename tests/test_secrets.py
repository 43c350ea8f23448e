"""No credential in any repr, str, error, log line or statistic, on both faces.

Sentinel credentials are planted in the configs (the async API's dict and vLLM's
``kv_connector_extra_config``, flat and in vLLM's nested ``store_config``, also with the wrong
types), a cache runs over moto with them (then with moto refusing them), and every text the
library produced is searched for the sentinels.
"""

from __future__ import annotations

import json
import logging
import random
import traceback
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import structlog

from _s3 import make_keys
from kvtier_async.api import CacheConfig, TieredKVCache
from kvtier_async.bench.s3server import MotoS3Server
from kvtier_async.config import ConfigError
from kvtier_async.integrations.vllm.config import ConnectorConfig
from kvtier_async.tiers.base import TierContext, make_tier
from kvtier_async.tiers.s3 import ObjTierConfig, S3Config

pytest_plugins = ["conftest_s3"]

SECRETS = {
    "access_key": "AKIASENTINEL0ACCESS9",
    "secret_key": "sentinel-secret-k3y-7f1e",
    "session_token": "sentinel-session-t0ken-c2d4",
}
BLOCK = 4096


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the obj tier is asyncio only


@pytest.fixture
def shown(caplog: pytest.LogCaptureFixture) -> Iterator[list[str]]:
    """Texts the test produced; at the end, every log line too (ours at DEBUG, others at
    INFO: botocore's own DEBUG lines print request headers, as in any boto3 program), and
    none may hold a sentinel."""
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="kvtier_async")
    texts: list[str] = []
    with structlog.testing.capture_logs() as captured:
        yield texts
    texts += [caplog.text, *(r.getMessage() for r in caplog.records), repr(captured)]
    texts += [str(r.__dict__) for r in caplog.records]
    leaks = [text for text in texts for secret in SECRETS.values() if secret in text]
    assert not leaks


def error_texts(error: BaseException) -> list[str]:
    return [str(error), repr(error), "".join(traceback.format_exception(error))]


def obj_tier(bucket: str = "kv", **extra: Any) -> dict[str, Any]:
    return {"type": "obj", "bucket": bucket, **SECRETS, **extra}


def nested_obj_tier(bucket: str = "kv") -> dict[str, Any]:
    return {"type": "obj", "store_config": {"bucket": bucket, **SECRETS}}


# -- reprs -------------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", [obj_tier(), nested_obj_tier()], ids=["flat", "store_config"])
def test_config_reprs_hide_credentials(tier: dict[str, Any], shown: list[str]) -> None:
    async_api = CacheConfig.from_dict(
        {"block_bytes": BLOCK, "num_slots": 4, "secondary_tiers": [tier]}
    )
    built = CacheConfig(block_bytes=BLOCK, num_slots=4, secondary_tiers=(tier,))
    vllm = ConnectorConfig.from_extra_config(
        {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [tier]}
    )
    s3 = S3Config.parse(tier, "secondary_tiers[0]")
    for config in (async_api, built, vllm):
        shown += [repr(config), str(config), repr(config.secondary_tiers)]
        shown += [str(config.secondary_tiers[0]), f"{config.secondary_tiers[0]}"]
        shown += [config.model_dump_json(), repr(config.model_dump())]
        (entry,) = config.secondary_tiers
        assert isinstance(entry, ObjTierConfig)
        assert "SecretStr('**********')" in repr(entry)
        # the values are all there, for the tier
        assert S3Config.from_config(entry).secret_key.reveal() == SECRETS["secret_key"]
    shown += [repr(s3), str(s3), json.dumps(s3.as_dict())]
    assert s3.secret_key.reveal() == SECRETS["secret_key"]


# -- errors ------------------------------------------------------------------------------------

WRONG_TYPES = [
    pytest.param(SECRETS["secret_key"].encode(), id="bytes"),
    pytest.param([SECRETS["secret_key"]], id="list"),
    pytest.param({"value": SECRETS["secret_key"]}, id="dict"),
]


@pytest.mark.parametrize("value", WRONG_TYPES)
@pytest.mark.parametrize("field", ["access_key", "secret_key", "session_token"])
@pytest.mark.parametrize("shape", ["flat", "store_config"])
def test_a_wrong_typed_credential_is_named_not_shown(
    value: Any, field: str, shape: str, shown: list[str]
) -> None:
    tier = obj_tier() if shape == "flat" else nested_obj_tier()
    (tier if shape == "flat" else tier["store_config"])[field] = value
    ctx = TierContext(block_bytes=BLOCK)
    for path in ("secondary_tiers[0]", "kv_connector_extra_config.secondary_tiers[0]"):
        with pytest.raises(ConfigError) as info:
            make_tier(tier, ctx, path)
        nested = ".store_config" if shape == "store_config" else ""
        assert info.value.field == f"{path}{nested}.{field}"
        message = f"must be a string, got {type(value).__name__} (value not shown)"
        assert message in str(info.value)
        shown += error_texts(info.value)


def test_a_cache_with_a_wrong_typed_credential_fails_without_showing_it(
    shown: list[str],
) -> None:
    config = {"block_bytes": BLOCK, "num_slots": 4,
              "secondary_tiers": [obj_tier(secret_key=SECRETS["secret_key"].encode())]}  # fmt: skip
    with pytest.raises(ConfigError, match=r"^secondary_tiers\[0\]\.secret_key: must be a") as info:
        TieredKVCache(config)  # refused with the rest of the config, before anything opens
    shown += error_texts(info.value)


def test_other_fields_still_show_what_was_wrong() -> None:
    with pytest.raises(
        ConfigError, match=r"secondary_tiers\[0\]\.region: must be a string, got b'x'"
    ):
        CacheConfig.from_dict(
            {"block_bytes": BLOCK, "num_slots": 4, "secondary_tiers": [obj_tier(region=b"x")]}
        )


# -- the async API, running ----------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_cache_over_s3_never_shows_its_credentials(
    moto_s3: MotoS3Server, s3_bucket: str, shown: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    tier = obj_tier(s3_bucket, endpoint_override=moto_s3.endpoint)
    config = {"block_bytes": BLOCK, "num_slots": 8, "secondary_tiers": [tier]}
    keys = make_keys(4)
    blocks = [np.full(BLOCK, i, np.uint8) for i in range(4)]
    async with TieredKVCache(config) as cache:
        await cache.store(keys[:2], blocks[:2])
        await cache.drain()
        moto_s3.set_auth(True)  # from now on every request is refused: errors, warnings
        try:
            await cache.store(keys[2:], blocks[2:])
            await cache.drain()
            assert await cache.lookup(make_keys(2)) == 0
        finally:
            moto_s3.set_auth(False)
        shown += [repr(cache.config), str(cache.stats()), repr(cache.tiers), repr(cache.stats())]
        shown += [repr(t.config) for t in cache.tiers]  # type: ignore[attr-defined]
        counters = cache.stats().tiers[0].counts
    assert counters.cascaded == 2 and counters.cascade_failed == 2
    inline = [r.getMessage() for r in caplog.records if "set inline" in r.getMessage()]
    assert len(inline) == 1  # one warning, naming the fields, pointing at the AWS chain
    assert "secondary_tiers[0].secret_key" in inline[0] and "AWS_ACCESS_KEY_ID" in inline[0]
    assert any("obj store failed" in r.getMessage() for r in caplog.records)


@pytest.mark.anyio
async def test_credentials_from_the_aws_chain_draw_no_warning(
    moto_s3: MotoS3Server,
    s3_bucket: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", SECRETS["access_key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRETS["secret_key"])
    caplog.set_level(logging.INFO, logger="kvtier_async")
    tier = {"type": "obj", "bucket": s3_bucket, "endpoint_override": moto_s3.endpoint}
    async with TieredKVCache({"block_bytes": BLOCK, "num_slots": 4, "secondary_tiers": [tier]}):
        pass
    assert "obj tier open" in caplog.text
    assert "set inline" not in caplog.text


# -- the vLLM face -------------------------------------------------------------------------------


@pytest.mark.vllm
def test_the_vllm_connector_never_shows_its_credentials(
    moto_s3: MotoS3Server, s3_bucket: str, shown: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("vllm")
    import vllm_harness as vh

    vh.load()
    # The harness's scheduler thread holds the GIL between its steps, so the tier's requests
    # (on the engine's thread) advance a switch interval at a time: on a slow machine the
    # first lookup took over the default 1 s. Time is not what this test is about.
    tier = obj_tier(s3_bucket, endpoint_override=moto_s3.endpoint, lookup_timeout_s=10)
    extra = {**vh.cpu_offloading(), "spec_name": "TieringOffloadingSpec", "secondary_tiers": [tier]}
    prompt = vh.random_tokens(random.Random(4), 70)
    with vh.VllmHarness(**{**vh.OURS, "extra_config": extra}, num_gpu_blocks=40) as h:
        h.add_request("first", prompt, max_tokens=2)
        h.run_until_done()
        scheduler = h.connector.scheduler
        assert scheduler.ledger.counters[0].cascaded > 0
        shown += [repr(scheduler.config), str(scheduler.config), repr(h.connector)]
        engine = scheduler.tier_work.threaded.engine
        shown += [repr(engine.tiers), *(str(t.statistics()) for t in engine.tiers)]
    inline = [r.getMessage() for r in caplog.records if "set inline" in r.getMessage()]
    assert len(inline) == 1
    assert "kv_connector_extra_config.secondary_tiers[0].access_key" in inline[0]
    wrong = obj_tier(s3_bucket, access_key=SECRETS["access_key"].encode())
    bad = {**extra, "secondary_tiers": [wrong]}
    with pytest.raises(ConfigError) as info:
        vh.VllmHarness(**{**vh.OURS, "extra_config": bad}, num_gpu_blocks=40)
    assert "secondary_tiers[0].access_key: must be a string, got bytes" in str(info.value)
    shown += error_texts(info.value)
