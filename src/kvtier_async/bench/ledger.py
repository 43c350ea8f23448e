"""Benchmark ``ledger``: our primary ledger against vLLM 0.33's ``CPUOffloadingManager``.

One seeded, serving-like trace drives both through the same calls. A few hundred documents
of 32-256 blocks are requested with Zipf popularity; a request is a prefix of a document
plus a unique suffix. The CPU tier holds 25% of the unique blocks, so eviction never stops.

Two call patterns, per policy. The main cases (``lru``, ``arc``) call the ledger the way
vLLM 0.33's scheduler calls its manager: look the keys up until the first miss, pin and
unpin the hits (a load), store the rest, finish the request; recency and frequency reach
the policy through those calls alone. The ``-touch`` cases add the classic ``touch`` of the
hits after the load. vLLM's manager gets the key positions its scheduler would set (before
the clock starts); ours derives them from the order of the calls.

Operations are the ledger calls the trace makes (one per lookup, load, unload, touch,
store, store completion, request finish), counted alike on both sides. Each repetition runs
ours and vLLM's back to back (alternating which goes first) on fresh ledgers; the best
repetition of each counts. ``hit_rate`` must be the same on both sides: same decisions.
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
TARGETS = {"lru": 5.0, "arc": 2.0}  # ops/s against vLLM, per policy
CASES = {  # case -> (policy, touch the hits)
    "lru": ("lru", False),
    "arc": ("arc", False),
    "lru-touch": ("lru", True),
    "arc-touch": ("arc", True),
}


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
    def __init__(self, policy: str, touch: bool, capacity: int) -> None:
        self.ledger = PrimaryLedger(capacity, policy=policy)
        self.touch = touch

    def request(self, index: int, keys: Sequence[bytes]) -> tuple[int, int, int]:
        led, req = self.ledger, index
        lookup, hit = led.lookup, LookupResult.HIT
        hits = 0
        for key in keys:
            if lookup(key) is not hit:
                break
            hits += 1
        ops = moved = hits + (hits < len(keys))
        head, rest = keys[:hits], keys[hits:]
        if head:
            led.prepare_load(head, req)
            led.complete_load(head)
            ops, moved = ops + 2, moved + 2 * hits
            if self.touch:
                led.touch(head, req)
                ops, moved = ops + 1, moved + hits
        if rest:
            out = led.prepare_store(rest, req)
            ops, moved = ops + 1, moved + len(rest)
            if out is not None:
                led.complete_store(out.keys_to_store)
                ops, moved = ops + 1, moved + len(out.keys_to_store)
        led.request_finished(req)
        led.take_events()
        return ops + 1, moved, hits


class _VLLM:
    """Drives vLLM's manager the way its connector's scheduler side does."""

    def __init__(self, policy: str, touch: bool, capacity: int, trace: Trace) -> None:
        base = importlib.import_module("vllm.v1.kv_offload.base")
        manager = importlib.import_module("vllm.v1.kv_offload.cpu.manager")
        self.manager: Any = manager.CPUOffloadingManager(
            capacity, cache_policy=policy, enable_events=True
        )
        self.touch = touch
        self.hit = base.LookupResult.HIT
        self.contexts = []
        for index, keys in enumerate(trace.requests):  # built before the clock starts
            ctx = base.ReqContext(req_id=str(index))
            for position, key in enumerate(keys, 1):
                ctx.set_offload_key_position(key, position * BLOCK_TOKENS)
            self.contexts.append(ctx)

    def request(self, index: int, keys: Sequence[bytes]) -> tuple[int, int, int]:
        mgr, ctx = self.manager, self.contexts[index]
        mgr.on_new_request(ctx)
        lookup, hit = mgr.lookup, self.hit
        hits = 0
        for key in keys:
            if lookup(key, ctx) is not hit:
                break
            hits += 1
        ops = moved = hits + (hits < len(keys))
        head, rest = keys[:hits], keys[hits:]
        if head:
            mgr.prepare_load(head, ctx)
            mgr.complete_load(head, ctx)
            ops, moved = ops + 2, moved + 2 * hits
            if self.touch:
                mgr.touch(head, ctx)
                ops, moved = ops + 1, moved + hits
        if rest:
            out = mgr.prepare_store(rest, ctx)
            ops, moved = ops + 1, moved + len(rest)
            if out is not None:
                mgr.complete_store(out.keys_to_store, ctx)
                ops, moved = ops + 1, moved + len(out.keys_to_store)
        mgr.on_request_finished(ctx)
        list(mgr.take_events())
        return ops + 1, moved, hits


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


def _interleaved(
    makers: Sequence[Callable[[], _Driver]], trace: Trace, repeats: int
) -> list[_Result]:
    """Best throughput of each maker's fresh runs; within a repetition they run back to back,
    first one first, then the other (hit rates are deterministic)."""
    runs: list[list[_Result]] = [[] for _ in makers]
    for repeat in range(repeats):
        order = range(len(makers)) if repeat % 2 == 0 else reversed(range(len(makers)))
        for index in order:
            runs[index].append(_drive(makers[index](), trace))
    return [max(results, key=lambda r: r.ops_per_s) for results in runs]


def _vllm_available() -> bool:
    try:
        import vllm.v1.kv_offload.cpu.manager  # noqa: F401
    except Exception:  # vLLM absent, or present but unusable here
        return False
    return True


def run(*, quick: bool = False, progress: Callable[[str], None] | None = None) -> list[BenchRecord]:
    """Run the trace through our ledger and (when installed) vLLM's, per case."""
    say = progress or (lambda _msg: None)
    trace = make_trace(num_requests=800 if quick else 4000)
    repeats = 1 if quick else 3
    with_vllm = _vllm_available()
    say(
        f"ledger: {len(trace.requests)} requests, {trace.unique_blocks} unique blocks, "
        f"capacity {trace.capacity}; vLLM reference {'on' if with_vllm else 'not installed'}"
    )
    records: list[BenchRecord] = []
    for case, (policy, touch) in CASES.items():
        makers: list[Callable[[], _Driver]] = [
            functools.partial(_Ours, policy, touch, trace.capacity)
        ]
        if with_vllm:
            makers.append(functools.partial(_VLLM, policy, touch, trace.capacity, trace))
        say(f"ledger: {case}: ours{' and vLLM, interleaved' if with_vllm else ''}")
        results = _interleaved(makers, trace, repeats)
        records += _records(case, TARGETS[policy], results[0], results[1] if with_vllm else None)
    return records


def _records(case: str, ops_target: float, ours: _Result, ref: _Result | None) -> list[BenchRecord]:
    def rec(metric: str, target: float | None, unit: str) -> BenchRecord:
        value: Any = getattr(ours, metric)
        reference = None if ref is None else getattr(ref, metric)
        return throughput_record(
            "ledger",
            case,
            metric,
            value,
            reference=reference,
            reference_name=None if ref is None else VLLM_NAME,
            target=None if ref is None else target,
            unit=unit,
        )

    return [
        rec("ops_per_s", ops_target, "ops/s"),
        rec("keys_per_s", None, "keys/s"),
        rec("hit_rate", 1.0, ""),
    ]
