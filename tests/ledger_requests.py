"""Helpers for the policy scenario tests: keys by number, and a request driven through a
`PrimaryLedger` the way vLLM 0.33's scheduler drives it (look up, load the hits, store the
rest, finish)."""

from __future__ import annotations

from typing import TypeVar

from kvtier_async.ledger import LookupResult, PrimaryLedger, make_offload_key
from kvtier_async.ledger.prefix_policy import PrefixPolicy
from kvtier_async.ledger.reuse_policy import ReusePolicy

P = TypeVar("P", bound=PrefixPolicy)


def k(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def ks(*ids: int) -> list[bytes]:
    return [k(i) for i in ids]


def policy_ledger(name: str, capacity: int, kind: type[P]) -> tuple[PrimaryLedger, P]:
    """A ledger of ``capacity`` slots on policy ``name``, and that policy, checked to be a
    ``kind``."""
    ledger = PrimaryLedger(capacity, policy=name)
    assert type(ledger.policy) is kind
    return ledger, ledger.policy


def request(ledger: PrimaryLedger, ids: list[int], req: object) -> int:
    """One request as vLLM's scheduler makes it; the number of leading hits."""
    keys = ks(*ids)
    hits = 0
    while hits < len(keys) and ledger.lookup(keys[hits]) is LookupResult.HIT:
        hits += 1
    if hits:
        ledger.prepare_load(keys[:hits], req)
        ledger.complete_load(keys[:hits])
    if hits < len(keys):
        out = ledger.prepare_store(keys[hits:], req)
        assert out is not None
        ledger.complete_store(out.keys_to_store)
    ledger.request_finished(req)
    return hits


def snapshot(policy: PrefixPolicy) -> tuple[object, ...]:
    """Everything a `PrefixPolicy` decides with, comparable with ``==``."""
    return (
        policy.private_keys,
        policy.shared_keys,
        dict(policy._score),
        dict(policy._next),
        list(policy._ghost_private.items()),
        list(policy._ghost_shared.items()),
        policy.target_private,
        policy._epoch,
        policy._inserted,
    )


def live(policy: ReusePolicy) -> list[tuple[int, bytes]]:
    """A `ReusePolicy` heap's live entries, sorted (stale ones may go at any pop)."""
    return sorted(entry for entry in policy._heap if policy._due.get(entry[1]) == entry[0])
