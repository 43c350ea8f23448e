"""`PrimaryLedger.walk` and `version`: the batched lookup the tiering ledger reads the primary
with, and the counter the vLLM connector's memo is keyed on."""

from __future__ import annotations

import random

import pytest

from kvtier_async.ledger import LedgerError, LookupResult, PrimaryLedger, make_offload_key

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


def k(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def ks(*ids: int) -> list[bytes]:
    return [k(i) for i in ids]


def by_lookup(
    led: PrimaryLedger, keys: list[bytes], start: int, waiting: set[bytes]
) -> tuple[int, int]:
    """``walk(keys, start, waiting)``, key by key with `lookup`."""
    results = [led.lookup(key) for key in keys[start:]]
    end = next(
        (
            i
            for i, (key, r) in enumerate(zip(keys[start:], results))
            if r is MISS and key not in waiting
        ),
        len(results),
    )
    ready = next((i for i, r in enumerate(results) if r is not HIT), len(results))
    return min(ready, end), start + end


def test_walk_counts_the_leading_ready_keys_and_finds_the_first_absent_one() -> None:
    led = PrimaryLedger(8)
    out = led.prepare_store(ks(1, 2, 3, 4))
    assert out is not None
    led.complete_store(ks(1, 2, 4))  # 3 is still being written
    assert led.walk(ks(1, 2, 3, 4, 5, 1)) == (2, 4)  # 5 is absent: the 1 after it is not read
    assert led.walk(ks(1, 2, 3, 4, 5), 2) == (0, 4)
    assert led.walk(ks(1, 2, 3, 4, 5), 3) == (1, 4)
    assert led.walk(ks(1, 2, 3, 4, 5), 4) == (0, 4)
    assert led.walk(ks(1, 2), 2) == (0, 2)  # the keys ran out
    assert led.walk([]) == (0, 0)
    # keys on their way from elsewhere: passed, not readable
    assert led.walk(ks(1, 5, 2, 6), 0, {k(5)}) == (1, 3)
    assert led.walk(ks(5, 1, 6), 0, {k(5), k(6)}) == (0, 3)
    assert led.walk(ks(1, 2, 4, 5), 0, {k(5)}) == (3, 4)


@pytest.mark.parametrize("seed", range(5))
def test_walk_answers_as_lookup_does_key_by_key(seed: int) -> None:
    rng = random.Random(seed)
    led = PrimaryLedger(10)
    writing: list[bytes] = []
    for _ in range(200):
        out = led.prepare_store(ks(*rng.sample(range(16), 3)))
        if out is not None:
            writing += out.keys_to_store
        if writing and rng.random() < 0.7:
            done = writing[: rng.randint(1, len(writing))]
            del writing[: len(done)]
            led.complete_store(done, success=rng.random() < 0.8)
        keys = ks(*rng.sample(range(16), rng.randint(0, 8)))
        start = rng.randint(0, len(keys))
        waiting = set(ks(*rng.sample(range(16), rng.randint(0, 4))))
        assert led.walk(keys, start, waiting) == by_lookup(led, keys, start, waiting)
        assert led.walk(keys, start) == by_lookup(led, keys, start, set())


def test_version_moves_with_each_change_a_walk_could_see() -> None:
    led = PrimaryLedger(2)
    version = led.version

    def moved() -> bool:
        nonlocal version
        moved, version = led.version != version, led.version
        return moved

    # queries, positions, recency, a request's end, a store of nothing new: no change
    led.lookup(k(1))
    led.walk(ks(1, 2))
    led.note_positions("r", ks(1, 2))
    led.touch(ks(1))
    led.request_finished("r")
    assert not moved()
    assert led.prepare_store(ks(1, 2)) is not None  # reserved: being written
    assert moved()
    assert led.prepare_store(ks(1, 2)) is not None  # nothing new to reserve
    assert not moved()
    assert led.complete_store(ks(1)) == ks(1)  # readable
    assert moved()
    assert led.complete_store(ks(1)) == []  # nothing finished
    assert not moved()
    led.prepare_load(ks(1))  # pinned: the room for a reservation is gone
    assert moved()
    assert led.prepare_store(ks(3)) is None  # refused: 1 is pinned, 2 being written
    assert not moved()
    with pytest.raises(LedgerError):
        led.prepare_load(ks(2))  # refused (being written): nothing changed
    assert not moved()
    led.complete_load(ks(1))
    assert moved()
    led.complete_store(ks(2), success=False)  # freed
    assert moved()
    assert led.prepare_store(ks(3, 4)) is not None  # evicts 1
    assert moved() and led.lookup(k(1)) is MISS
    led.reset()
    assert moved()
