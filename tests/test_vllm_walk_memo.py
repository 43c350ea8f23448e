"""The connector's one walk memo (``_Request.walked``, keyed on `TieringLedger.version`):
an ask while nothing changed gets the last answer without a walk, and any change of the
ledger a walk could see between two asks makes the next one walk (never a stale answer)."""

from __future__ import annotations

from typing import Any

import pytest

import vllm_harness as vh
from vllm_harness import OURS

pytestmark = pytest.mark.vllm

BLOCK_BYTES = 4 << 10  # the harness's default shapes: 2 layers x 2 KiB per block


@pytest.fixture(scope="module", autouse=True)
def _vllm() -> None:
    pytest.importorskip("vllm")
    vh.load()


class _Waiting:
    """What ``get_num_new_matched_tokens`` reads of a waiting request."""

    def __init__(self, req_id: str, block_hashes: list[bytes]) -> None:
        self.request_id = req_id
        self.block_hashes = block_hashes
        self.num_tokens = 16 * len(block_hashes) + 5


def _counting(led: Any) -> list[int]:
    walks: list[int] = []
    walk = led.walk_prefix

    def counted(req: Any, groups: Any) -> Any:
        walks.append(1)
        return walk(req, groups)

    led.walk_prefix = counted
    return walks


def test_a_key_evicted_while_the_walk_waits_makes_the_next_ask_walk() -> None:
    """A request's walk hits its first block and waits on the second (being written). The
    first block is then evicted: the next ask walks again and answers 0 ("ask again"
    would be stale: no walk now waits on anything)."""
    from kvtier_async.ledger import LookupResult, make_offload_key

    extra = {**OURS["extra_config"], "cpu_bytes_to_use": 4 * BLOCK_BYTES}  # 4 slots
    with vh.VllmHarness(num_gpu_blocks=40, **{**OURS, "extra_config": extra}) as h:
        scheduler = h.connector.scheduler
        led = scheduler.ledger
        assert led.primary.num_slots == 4
        hashes = [bytes([i + 1]) * 32 for i in range(3)]
        keys = [make_offload_key(x, 0) for x in hashes]
        out = led.prepare_store(keys[:2], "writer")
        assert out is not None
        led.complete_store(keys[:1])  # the first readable, the second still being written
        walks = _counting(led)
        request = _Waiting("waiting", hashes)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
        assert len(walks) == 1  # nothing changed: the memo answered
        # three more blocks stored: the first block, the only idle one, is evicted
        fillers = [make_offload_key(bytes([100 + i]) * 32, 0) for i in range(3)]
        out = led.prepare_store(fillers, "filler")
        assert out is not None and out.evicted_keys == keys[:1]
        assert led.primary.lookup(keys[0]) is LookupResult.MISS
        assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
        assert len(walks) == 2
        led.complete_store([*keys[1:2], *fillers])
        scheduler.request_finished(request)
        scheduler._finish("waiting")
        for req in ("writer", "filler"):
            led.request_finished(req)


def test_the_hits_answered_grow_and_shrink_with_the_ledger() -> None:
    """A request asked again with its hits pinned: answered from the memo while nothing
    changed; a block stored after its hits makes the answer grow, and a block pinned for
    another request changes nothing it reads but still walks (with the same pins kept)."""
    from kvtier_async.ledger import make_offload_key

    with vh.VllmHarness(num_gpu_blocks=40, **OURS) as h:
        scheduler = h.connector.scheduler
        led = scheduler.ledger
        hashes = [bytes([i + 1]) * 32 for i in range(5)]
        keys = [make_offload_key(x, 0) for x in hashes]

        def store(*index: int) -> None:
            out = led.prepare_store([keys[i] for i in index], "writer")
            assert out is not None
            led.complete_store(out.keys_to_store)

        store(0, 1)
        walks = _counting(led)
        request = _Waiting("waiting", hashes)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (32, True)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (32, True)
        assert len(walks) == 1
        store(2)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (48, True)
        assert len(walks) == 2
        pinned = scheduler._reqs["waiting"].pinned_slots
        led.prepare_load(keys[:1], "other")  # another request's pin: a walk again, same hits
        assert scheduler.get_num_new_matched_tokens(request, 0) == (48, True)
        assert len(walks) == 3
        assert scheduler._reqs["waiting"].pinned_slots is pinned  # kept, not taken again
        assert [led.primary.ref_count(key) for key in keys[:3]] == [2, 1, 1]
        led.complete_load(keys[:1])
        scheduler.request_finished(request)
        assert [led.primary.ref_count(key) for key in keys[:3]] == [0, 0, 0]
        scheduler._finish("waiting")
        for req in ("writer", "other"):
            led.request_finished(req)
