"""The fleet index against vLLM's own objects: vLLM's block hashes and vLLM's
``ZmqEventPublisher`` (its PUB socket and its replay ROUTER), driven side by side with ours
on the same inputs. No engine: vLLM's CPU build is only imported (``nox -s fleet``)."""

from __future__ import annotations

import asyncio
import random
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest

from kvtier_async.fleet import BlockHasher, FleetIndex
from kvtier_async.fleet.feed import Feed

pytestmark = [pytest.mark.e2e, pytest.mark.fleet]

with warnings.catch_warnings():  # vLLM's and torch's import-time warnings are not ours
    warnings.simplefilter("ignore")
    import vllm.distributed.kv_events
    import vllm.sampling_params
    import vllm.utils.hashing
    import vllm.v1.core.kv_cache_utils
    import vllm.v1.request  # noqa: F401


@pytest.mark.parametrize("seed", [None, "12345"])
@pytest.mark.parametrize("block_size", [16, 128])
def test_block_hashes_are_vllms(
    seed: str | None, block_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    kv_cache_utils.init_none_hash(sha256)
    rng = random.Random(block_size)
    tokens = [rng.randrange(32000) for _ in range(4 * block_size + 5)]
    theirs, parent = [], None
    for i in range(len(tokens) // block_size):
        parent = kv_cache_utils.hash_block_tokens(
            sha256, parent, tokens[i * block_size : (i + 1) * block_size]
        )
        theirs.append(bytes(parent))
    assert BlockHasher(block_size, seed=seed).hashes(tokens) == theirs
    # A request's own block hasher, as the scheduler builds it, agrees too.
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    hasher = kv_cache_utils.get_request_block_hasher(block_size, sha256)
    request = Request("r", tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher)
    assert [bytes(h) for h in request.block_hashes] == theirs
    monkeypatch.undo()
    kv_cache_utils.init_none_hash(sha256)  # as it was: the environment's seed


async def _until(condition: Callable[[], bool], deadline_s: float = 30.0) -> None:
    async with asyncio.timeout(deadline_s):
        while not condition():
            await asyncio.sleep(0.01)  # a socket fills the index: polled, with a deadline


def _batch(events: list[Any]) -> Any:
    from vllm.distributed.kv_events import KVEventBatch

    return KVEventBatch(ts=time.time(), events=events)


def _stored(hashes: list[bytes], medium: str, ownership: str | None = None) -> Any:
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=[],
        block_size=0,
        lora_id=None,
        medium=medium,
        lora_name=None,
        ownership=ownership,
    )


def test_vllms_publisher_feeds_the_index_and_its_replay_fills_a_late_start() -> None:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, ZmqEventPublisher

    hasher = BlockHasher(16)
    tokens = list(range(160))
    hashes = hasher.hashes(tokens)

    async def main() -> tuple[Any, Any, Any]:
        index = FleetIndex(["a"])
        feed = Feed(index, "tcp://127.0.0.1:0")
        where = feed.open()
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            replay = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        feed.replay = {"a": replay}
        publisher = ZmqEventPublisher(0, endpoint=where, replay_endpoint=replay, topic="a")
        try:
            # Published before the index listens to its socket: lost live, kept for replay.
            publisher.publish(_batch([_stored(hashes[:6], "GPU")]))
            publisher.publish(_batch([_stored(hashes[:4], "CPU")]))
            await asyncio.sleep(0.5)  # let vLLM's thread send them into the void
            task = asyncio.get_running_loop().create_task(feed.run())
            first = None
            for _ in range(500):  # until one got through the PUB's slow join
                publisher.publish(_batch([_stored(hashes, "STORAGE", "fs[0]")]))
                await asyncio.sleep(0.02)
                if index.stats()[0].batches >= 3:
                    first = index.match(hasher.keys(tokens))
                    break
            await _until(lambda: not index.stats()[0].replaying and index.stats()[0].batches >= 3)
            first = index.match(hasher.keys(tokens))
            publisher.publish(_batch([BlockRemoved(block_hashes=[hashes[2]], medium="GPU")]))
            await _until(lambda: index.match(hasher.keys(tokens)).gpu["a"] == 2)
            second = index.match(hasher.keys(tokens))
            publisher.publish(_batch([AllBlocksCleared()]))
            await _until(lambda: index.match(hasher.keys(tokens)).cpu["a"] == 0)
            task.cancel()
            return first, second, index.stats()[0]
        finally:
            publisher.shutdown()
            feed.close()

    first, second, stats = asyncio.run(main())
    assert (first.gpu["a"], first.cpu["a"], first.storage["fs[0]"]) == (6, 4, 10)
    assert second.gpu["a"] == 2
    assert stats.replayed >= 2 and stats.resyncs == 0 and stats.malformed == 0
