"""Benchmark ``ledger``: our primary ledger against vLLM 0.33's ``CPUOffloadingManager``.

One seeded, serving-like trace drives both through the same calls. A few hundred documents
of 32-256 blocks are requested with Zipf popularity; a request is a prefix of a document
plus a unique suffix. Per request: look the keys up until the first miss, pin and unpin the
hits (a load), touch them, store the rest, and finish the request. The CPU tier holds 25% of
the unique blocks, so eviction never stops. Operations are the ledger calls the trace makes
(one per lookup, load, unload, touch, store, store completion), counted alike on both sides.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvtier_async.ledger import LookupResult, PrimaryLedger, make_offload_key

from .report import BenchRecord, throughput_record

__all__ = ["Trace", "make_trace", "run"]

BLOCK_TOKENS = 16
VLLM_NAME = "vllm-0.33 CPUOffloadingManager"
TARGETS = {"lru": 5.0, "arc": 2.0}


@dataclass(frozen=True)
class Trace:
    requests: list[list[bytes]]  # keys of each request, head -> tail
    unique_blocks: int

    @property
    def capacity(self) -> int:
        return max(1, self.unique_blocks // 4)


def make_trace(
    num_docs: int = 300, num_requests: int = 4000, seed: int = 0, zipf_s: float = 1.1
) -> Trace:
    """The seeded trace; block keys chain like vLLM's prefix hashes."""
    rng = random.Random(seed)
    docs = [_chain(f"doc{d}", rng.randint(32, 256)) for d in range(num_docs)]
    weights = [1.0 / (rank + 1) ** zipf_s for rank in range(num_docs)]
    requests = []
    for r in range(num_requests):
        doc = docs[rng.choices(range(num_docs), weights)[0]]
        prefix = doc[: rng.randint(len(doc) // 2, len(doc))]
        suffix = _chain(f"req{r}", rng.randint(2, 16), parent=prefix[-1])
        requests.append(prefix + suffix)
    unique = len({key for keys in requests for key in keys})
    return Trace(requests, unique)


def _chain(name: str, n: int, parent: bytes = b"") -> list[bytes]:
    keys: list[bytes] = []
    h = hashlib.sha256(parent + name.encode()).digest()
    for i in range(n):
        h = hashlib.sha256(h + i.to_bytes(4, "big")).digest()
        keys.append(make_offload_key(h, 0))
    return keys


class _Driver(Protocol):
    def request(self, index: int, keys: Sequence[bytes]) -> tuple[int, int, int]:
        """Run one request; return (operations, keys passed, hit blocks)."""


class _Ours:
    def __init__(self, policy: str, capacity: int) -> None:
        self.ledger = PrimaryLedger(capacity, policy=policy)

    def request(self, index: int, keys: Sequence[bytes]) -> tuple[int, int, int]:
        led, req = self.ledger, index
        hits = 0
        for key in keys:
            if led.lookup(key) is not LookupResult.HIT:
                break
            hits += 1
        ops, moved = hits + (hits < len(keys)), hits + (hits < len(keys))
        head, rest = keys[:hits], keys[hits:]
        if head:
            led.prepare_load(head)
            led.complete_load(head)
            led.touch(head, req)
            ops, moved = ops + 3, moved + 3 * hits
        if rest:
            out = led.prepare_store(rest, req)
            ops, moved = ops + 1, moved + len(rest)
            if out is not None:
                led.complete_store(out.keys_to_store)
                ops, moved = ops + 1, moved + len(out.keys_to_store)
        led.request_finished(req)
        led.take_events()
        return ops, moved, hits


class _VLLM:
    """Drives vLLM's manager the way its connector's scheduler side does."""

    def __init__(self, policy: str, capacity: int, trace: Trace) -> None:
        base = importlib.import_module("vllm.v1.kv_offload.base")
        manager = importlib.import_module("vllm.v1.kv_offload.cpu.manager")
        self.manager: Any = manager.CPUOffloadingManager(
            capacity, cache_policy=policy, enable_events=True
        )
        self.hit = LookupResult.HIT.name
        self.contexts = []
        for index, keys in enumerate(trace.requests):  # built before the clock starts
            ctx = base.ReqContext(req_id=str(index))
            for position, key in enumerate(keys, 1):
                ctx.set_offload_key_position(key, position * BLOCK_TOKENS)
            self.contexts.append(ctx)

    def request(self, index: int, keys: Sequence[bytes]) -> tuple[int, int, int]:
        mgr, ctx = self.manager, self.contexts[index]
        mgr.on_new_request(ctx)
        hits = 0
        for key in keys:
            if mgr.lookup(key, ctx).name != self.hit:
                break
            hits += 1
        ops, moved = hits + (hits < len(keys)), hits + (hits < len(keys))
        head, rest = keys[:hits], keys[hits:]
        if head:
            mgr.prepare_load(head, ctx)
            mgr.complete_load(head, ctx)
            mgr.touch(head, ctx)
            ops, moved = ops + 3, moved + 3 * hits
        if rest:
            out = mgr.prepare_store(rest, ctx)
            ops, moved = ops + 1, moved + len(rest)
            if out is not None:
                mgr.complete_store(out.keys_to_store, ctx)
                ops, moved = ops + 1, moved + len(out.keys_to_store)
        mgr.on_request_finished(ctx)
        list(mgr.take_events())
        return ops, moved, hits


@dataclass(frozen=True)
class _Result:
    ops_per_s: float
    keys_per_s: float
    hit_rate: float


def _drive(driver: _Driver, trace: Trace) -> _Result:
    ops = moved = hits = 0
    start = time.perf_counter()
    for index, keys in enumerate(trace.requests):
        o, m, h = driver.request(index, keys)
        ops, moved, hits = ops + o, moved + m, hits + h
    elapsed = time.perf_counter() - start
    total = sum(len(keys) for keys in trace.requests)
    return _Result(ops / elapsed, moved / elapsed, hits / total)


def _best(make: Callable[[], _Driver], trace: Trace, repeats: int) -> _Result:
    """Best throughput of ``repeats`` fresh runs (hit rate is deterministic)."""
    results = [_drive(make(), trace) for _ in range(repeats)]
    return max(results, key=lambda r: r.ops_per_s)


def _vllm_available() -> bool:
    try:
        import vllm.v1.kv_offload.cpu.manager  # noqa: F401
    except Exception:  # vLLM absent, or present but unusable here
        return False
    return True


def run(*, quick: bool = False, progress: Callable[[str], None] | None = None) -> list[BenchRecord]:
    """Run the trace through our ledger and (when installed) vLLM's, per policy."""
    say = progress or (lambda _msg: None)
    trace = make_trace(num_requests=800 if quick else 4000)
    repeats = 1 if quick else 3
    with_vllm = _vllm_available()
    say(
        f"ledger: {len(trace.requests)} requests, {trace.unique_blocks} unique blocks, "
        f"capacity {trace.capacity}; vLLM reference {'on' if with_vllm else 'not installed'}"
    )
    records: list[BenchRecord] = []
    for policy in ("lru", "arc"):
        say(f"ledger: {policy}: ours")
        ours = _best(functools.partial(_Ours, policy, trace.capacity), trace, repeats)
        ref = None
        if with_vllm:
            say(f"ledger: {policy}: vLLM")
            ref = _best(functools.partial(_VLLM, policy, trace.capacity, trace), trace, repeats)
        records += _records(policy, ours, ref)
    return records


def _records(policy: str, ours: _Result, ref: _Result | None) -> list[BenchRecord]:
    def rec(metric: str, target: float | None, unit: str) -> BenchRecord:
        value: Any = getattr(ours, metric)
        reference = None if ref is None else getattr(ref, metric)
        return throughput_record(
            "ledger",
            policy,
            metric,
            value,
            reference=reference,
            reference_name=None if ref is None else VLLM_NAME,
            target=None if ref is None else target,
            unit=unit,
        )

    return [
        rec("ops_per_s", TARGETS[policy], "ops/s"),
        rec("keys_per_s", None, "keys/s"),
        rec("hit_rate", 1.0, ""),
    ]
