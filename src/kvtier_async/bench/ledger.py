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

The ``prefix`` policy is not vLLM's, so its reference is vLLM's ARC: the ``prefix`` case
runs it on the main trace beside vLLM's ARC (ops/s, and a hit rate at least ARC's). Its
hit rate is then swept over three seeded traces, each at 10%, 25% and 50% of its unique
blocks: ``docs`` (the main trace), ``docmix`` (Zipf 0.8, documents of 16-1024 blocks,
log-uniform) and ``chat`` (multi-turn sessions, each turn's prompt the previous prompt plus
a reply and a new message, 128 sessions interleaved, four shared system prompts). Per case:
prefix against vLLM's ARC (target: never below), our LRU (vLLM's LRU decisions) for scale,
and Belady's offline optimum (it knows the future) as the ceiling; then the mean of
prefix's ratios over the cases (target 1.1); the other policies not vLLM's
(`OTHER_POLICIES`: ``reuse``, ``sieve``, ``s3fifo``, ``tinylfu``) against the better of
vLLM's LRU and ARC, for scale; and the ``adaptive`` policy (`NEW_POLICY`, the default choice
among them) against the same (target: never below 0.99x). The hit rate is the bench's
throughout: per request, the leading keys that are readable until the first miss.

Real traces (`trace_case`). ``kvtier bench ledger --trace FILE`` replays a trace file (the
Mooncake format, or kvtier's own JSONL: see `kvtier_async.ops.traces`) with the same call
pattern, at 10%, 25% and 50% of its distinct blocks (10% only with ``--quick``): the hit
rate of vLLM's LRU and ARC, ours (``lru`` and ``arc`` must hit exactly as vLLM's do: the
run fails if not), each of `OTHER_POLICIES` and ``adaptive`` (against the better of vLLM's
two; ``adaptive``'s target: 1.05x at 10% and 25%, 0.99x at 50%), Belady's and the infinite
cache's (every block kept: the leading keys an earlier request had) as bounds, and
``adaptive``'s ops/s against vLLM's ARC (target 1.5x), the two interleaved as above. Two
more rows tell how much of the distance to those bounds is admission, the choice of which
new blocks to store: our ``lru`` behind the oracle's filter (`admission_oracle`: it stores
only the blocks a later request names), and behind the best of a few filters fitted to the
trace itself on what is known when a block is stored (`fitted_admission`; fitted in-sample,
so above what such a filter would do on traffic it has not seen). A full run without
``--trace`` ends with this case on the published conversation trace the policies were
developed on (`STANDING_TRACE`: ``../shared/traces/mooncake-conversation.jsonl`` beside the
checkout), when it is there, and on a published trace they were not developed on
(`HELD_OUT_TRACE`: Mooncake's synthetic workload, ``traces/`` in the checkout). A block id
``n`` of a trace is the key of block hash ``n`` (8 bytes, big endian), KV group 0.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import importlib
import itertools
import math
import random
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kvtier_async.ledger import LookupResult, PrimaryLedger, prefix_keys
from kvtier_async.ops.traces import TraceFile, read_trace

from .report import BenchRecord, throughput_record

__all__ = [
    "Trace",
    "belady_hit_rate",
    "infinite_hit_rate",
    "make_chat_trace",
    "make_docmix_trace",
    "make_trace",
    "policy_hit_rate",
    "run",
    "trace_case",
]

BLOCK_TOKENS = 16
VLLM_NAME = "vllm-0.33 CPUOffloadingManager"
VLLM_ARC_NAME = "vllm-0.33 CPUOffloadingManager, arc"
NEW_POLICY = "adaptive"  # the default choice, judged on every trace (see `trace_case`)
#: the other policies not vLLM's, measured beside it
OTHER_POLICIES = ("prefix", "reuse", "sieve", "s3fifo", "tinylfu")
VLLM_BEST_NAME = "vllm-0.33 CPUOffloadingManager, the better of lru and arc"
TARGETS = {"lru": 5.0, "arc": 2.0, "prefix": 2.0, NEW_POLICY: 1.5}  # ops/s against vLLM
# (prefix and NEW_POLICY: against its ARC)
FLOOR_TARGET = 0.99  # NEW_POLICY's hit rate against the better of vLLM's LRU and ARC
LIFT_TARGET = 1.05  # ... on a real trace at 10% and 25% of its distinct blocks
LIFT_FRACTIONS = (0.10, 0.25)
STANDING_TRACE = (
    Path(__file__).resolve().parents[3].parent / "shared" / "traces" / "mooncake-conversation.jsonl"
)  # the published conversation trace beside the checkout (../shared/traces)
#: a published trace the policies were not developed on, kept in the checkout (traces/)
HELD_OUT_TRACE = Path(__file__).resolve().parents[3] / "traces" / "mooncake-synthetic.jsonl.gz"
CASES = {  # case -> (policy, touch the hits)
    "lru": ("lru", False),
    "arc": ("arc", False),
    "lru-touch": ("lru", True),
    "arc-touch": ("arc", True),
}


SWEEP_FRACTIONS = (0.10, 0.25, 0.50)  # of a trace's unique blocks
SWEEP_TARGET = 1.1  # prefix's mean hit-rate ratio to vLLM's ARC over the sweep
#: the fitted admission filters' thresholds tried (`fitted_admission`); 0 admits every key
ADMISSION_THRESHOLDS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4)


@dataclass(frozen=True)
class Trace:
    requests: list[list[bytes]]  # keys of each request, head -> tail
    unique_blocks: int

    @property
    def capacity(self) -> int:
        return self.capacity_at(0.25)

    def capacity_at(self, fraction: float) -> int:
        """Slots for ``fraction`` of the unique blocks."""
        return max(1, int(self.unique_blocks * fraction))

    @classmethod
    def of(cls, requests: list[list[bytes]]) -> Trace:
        return cls(requests, len({key for keys in requests for key in keys}))


def make_trace(
    num_docs: int = 300, num_requests: int = 4000, seed: int = 0, zipf_s: float = 1.1
) -> Trace:
    """The main trace (``docs``); block keys chain like vLLM's prefix hashes."""
    rng = random.Random(seed)
    docs = [_chain(f"doc{d}", rng.randint(32, 256)) for d in range(num_docs)]
    return _doc_requests(rng, docs, num_requests, zipf_s, "req")


def make_docmix_trace(
    num_docs: int = 300, num_requests: int = 4000, seed: int = 1, zipf_s: float = 0.8
) -> Trace:
    """``docmix``: flatter popularity, documents of 16-1024 blocks (log-uniform)."""
    rng = random.Random(seed)
    docs = [_chain(f"mix{d}", round(16 * 64 ** rng.random())) for d in range(num_docs)]
    return _doc_requests(rng, docs, num_requests, zipf_s, "mixreq")


def _doc_requests(
    rng: random.Random, docs: list[list[bytes]], num_requests: int, zipf_s: float, tag: str
) -> Trace:
    """Requests: a Zipf-popular document's prefix (half of it or more) + a unique suffix."""
    weights = [1.0 / (rank + 1) ** zipf_s for rank in range(len(docs))]
    requests = []
    for r in range(num_requests):
        doc = docs[rng.choices(range(len(docs)), weights)[0]]
        prefix = doc[: rng.randint(len(doc) // 2, len(doc))]
        suffix = _chain(f"{tag}{r}", rng.randint(2, 16), parent=prefix[-1])
        requests.append(prefix + suffix)
    return Trace.of(requests)


def make_chat_trace(
    num_requests: int = 4000, seed: int = 2, sessions: int = 128, num_system: int = 4
) -> Trace:
    """``chat``: ``sessions`` multi-turn sessions interleaved (a request continues one at
    random); a turn's prompt is the previous prompt + the reply (2-24 blocks) + a new message
    (1-8 blocks); a session opens with one of ``num_system`` system prompts (8-64 blocks,
    Zipf 1 popular) and a first message (1-32 blocks), lasts 1-24 turns (geometric, mean
    about 7), and is replaced by a new one when it ends."""
    rng = random.Random(seed)
    systems = [_chain(f"sys{s}", rng.randint(8, 64)) for s in range(num_system)]
    weights = [1.0 / (s + 1) for s in range(num_system)]
    opened = 0

    def open_session() -> tuple[list[bytes], int, int]:
        nonlocal opened
        opened += 1
        system = systems[rng.choices(range(num_system), weights)[0]]
        turns = 1
        while turns < 24 and rng.random() > 1 / 7:
            turns += 1
        first = _chain(f"s{opened}m0", rng.randint(1, 32), parent=system[-1])
        return system + first, turns, opened

    live = [open_session() for _ in range(sessions)]
    done = [0] * sessions
    requests = []
    for _ in range(num_requests):
        i = rng.randrange(sessions)
        prompt, turns, name = live[i]
        requests.append(prompt)
        done[i] += 1
        if done[i] >= turns:
            live[i], done[i] = open_session(), 0
        else:
            more = rng.randint(2, 24) + rng.randint(1, 8)
            live[i] = (prompt + _chain(f"s{name}t{done[i]}", more, parent=prompt[-1]), turns, name)
    return Trace.of(requests)


SWEEP_TRACES: dict[str, Callable[[int], Trace]] = {
    "docs": lambda n: make_trace(num_requests=n),
    "docmix": lambda n: make_docmix_trace(num_requests=n),
    "chat": lambda n: make_chat_trace(num_requests=n),
}


def _chain(name: str, n: int, parent: bytes = b"") -> list[bytes]:
    """``n`` block keys by the public chain (`prefix_keys`), continuing ``parent`` if given:
    block ``i`` holds the two tokens ``(tag, i)``, ``tag`` a 56-bit digest of ``name``, so
    chains of different names (or parents) share no key."""
    tag = int.from_bytes(hashlib.sha256(name.encode()).digest()[:7], "big")
    tokens = [token for i in range(n) for token in (tag, i)]
    return prefix_keys(tokens, block_tokens=2, parent=parent or None)


class _Driver(Protocol):
    def request(self, index: int, keys: Sequence[bytes]) -> tuple[int, int, int]:
        """Run one request; return (operations, keys passed, hit blocks)."""


class _Ours:
    """Drives our ledger; with ``admit`` (per request, per key: whether to store it, as
    `admission_oracle` and `fitted_admission` give), only the admitted keys of a request's
    misses are stored."""

    def __init__(
        self, policy: str, touch: bool, capacity: int, admit: Sequence[list[bool]] | None = None
    ) -> None:
        self.ledger = PrimaryLedger(capacity, policy=policy)
        self.touch = touch
        self.admit = admit

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
        if self.admit is not None:
            rest = list(itertools.compress(rest, self.admit[index][hits:]))
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


def run(
    *,
    quick: bool = False,
    progress: Callable[[str], None] | None = None,
    trace: str | Path | None = None,
    trace_format: str = "auto",
) -> list[BenchRecord]:
    """Run the trace through our ledger and (when installed) vLLM's, per case; then the
    hit-rate sweep over the generated traces and the standing real trace (when found; not
    in a quick run). With ``trace`` (a file, see `traces`), only that file's case."""
    say = progress or (lambda _msg: None)
    if trace is not None:
        return trace_case(read_trace(trace, trace_format), quick=quick, say=say)
    num_requests = 800 if quick else 4000
    docs = make_trace(num_requests=num_requests)
    repeats = 1 if quick else 3
    with_vllm = _vllm_available()
    say(
        f"ledger: {len(docs.requests)} requests, {docs.unique_blocks} unique blocks, "
        f"capacity {docs.capacity}; vLLM reference {'on' if with_vllm else 'not installed'}"
    )
    records: list[BenchRecord] = []
    for case, (policy, touch) in CASES.items():
        records += _policy_case(case, policy, touch, policy, docs, repeats, with_vllm, say)
    records += _policy_case("prefix", "prefix", False, "arc", docs, repeats, with_vllm, say)
    traces = {"docs": docs}
    for name, make in SWEEP_TRACES.items():
        traces.setdefault(name, make(num_requests))
    records += _sweep(traces, with_vllm, say)
    if not quick:
        for path, what in ((STANDING_TRACE, "standing"), (HELD_OUT_TRACE, "held-out")):
            if path.is_file():
                records += trace_case(read_trace(path), quick=False, say=say)
            else:
                say(f"ledger: the {what} trace {path} is not here: its case is skipped")
    return records


def trace_case(source: TraceFile, *, quick: bool, say: Callable[[str], None]) -> list[BenchRecord]:
    """A trace file's case, per capacity (10%, 25% and 50% of its distinct blocks; 10% only
    when quick): the hit rate of each policy, Belady's and the infinite cache's, and the
    ops/s of `NEW_POLICY` against vLLM's ARC, interleaved. Our ``lru`` and ``arc`` must hit
    exactly as vLLM's do (`AssertionError` if not)."""
    trace = Trace.of(source.requests)
    with_vllm = _vllm_available()
    repeats = 1 if quick else 3
    fractions = SWEEP_FRACTIONS[:1] if quick else SWEEP_FRACTIONS
    accesses = sum(map(len, trace.requests))
    say(
        f"ledger: trace {source.name} ({source.format}): {len(trace.requests)} requests, "
        f"{accesses} block accesses, {trace.unique_blocks} distinct blocks"
    )
    infinite = infinite_hit_rate(trace)
    oracle = admission_oracle(trace)
    fitted = fitted_admission(trace, oracle)
    records: list[BenchRecord] = []
    for fraction in fractions:
        capacity = trace.capacity_at(fraction)
        case = f"{source.name}@{fraction:.0%}"
        say(f"ledger: {case}: capacity {capacity}")
        makers: list[Callable[[], _Driver]] = [
            functools.partial(_Ours, NEW_POLICY, False, capacity)
        ]
        if with_vllm:
            makers.append(functools.partial(_VLLM, "arc", False, capacity, trace))
        timed = _interleaved(makers, trace, repeats)
        ours = {NEW_POLICY: timed[0]}
        for policy in ("lru", "arc", *OTHER_POLICIES):
            ours[policy] = _drive(_Ours(policy, False, capacity), trace)
        vllm = {}
        if with_vllm:
            vllm = {"arc": timed[1], "lru": _drive(_VLLM("lru", False, capacity, trace), trace)}
            _check_parity(case, ours, vllm)
        best = max(r.hit_rate for r in vllm.values()) if vllm else None
        best_name = VLLM_BEST_NAME if vllm else None
        for policy in ("lru", "arc"):
            reference = vllm[policy].hit_rate if vllm else None
            name = VLLM_NAME if policy == "lru" else VLLM_ARC_NAME
            target = 1.0 if vllm else None
            records.append(
                _hit_rate(
                    f"{case}/{policy}",
                    ours[policy].hit_rate,
                    reference,
                    name if vllm else None,
                    target,
                )
            )
        lift = LIFT_TARGET if any(math.isclose(fraction, f) for f in LIFT_FRACTIONS) else None
        judged = ((policy, None) for policy in OTHER_POLICIES)
        for policy, target in (*judged, (NEW_POLICY, lift or FLOOR_TARGET)):
            records.append(
                _hit_rate(
                    f"{case}/{policy}",
                    ours[policy].hit_rate,
                    best,
                    best_name,
                    target if vllm else None,
                )
            )
        perfect, fitted_rate, threshold = admission_hit_rates(
            trace, capacity, oracle, fitted, ours["lru"].hit_rate
        )
        say(f"ledger: {case}: lru behind the fitted filter: best at threshold {threshold}")
        bounds = {
            "lru-fitted-admission": fitted_rate,
            "lru-oracle-admission": perfect,
            "belady": belady_hit_rate(trace, capacity),
            "infinite": infinite,
        }
        for bound, rate in bounds.items():
            records.append(_hit_rate(f"{case}/{bound}", rate, best, best_name, None))
        records.append(
            throughput_record(
                "ledger",
                f"{case}/{NEW_POLICY}",
                "ops_per_s",
                ours[NEW_POLICY].ops_per_s,
                reference=vllm["arc"].ops_per_s if vllm else None,
                reference_name=VLLM_ARC_NAME if vllm else None,
                target=TARGETS[NEW_POLICY] if vllm else None,
                unit="ops/s",
            )
        )
    return records


def _check_parity(case: str, ours: dict[str, _Result], vllm: dict[str, _Result]) -> None:
    """Our LRU and ARC make vLLM's decisions: the same hit rate, exactly."""
    for policy, reference in vllm.items():
        if ours[policy].hit_rate != reference.hit_rate:
            raise AssertionError(
                f"ledger {case}: our {policy} hit {ours[policy].hit_rate!r}, vLLM's "
                f"{reference.hit_rate!r}: the decisions differ"
            )


def policy_hit_rate(trace: Trace, policy: str, capacity: int) -> float:
    """Our ledger's hit rate on ``trace`` with ``policy`` at ``capacity`` slots, called as
    vLLM 0.33's scheduler calls its manager (no touch)."""
    return _drive(_Ours(policy, False, capacity), trace).hit_rate


def _known_head(keys: Sequence[bytes], known: Container[bytes]) -> int:
    """How many of ``keys``' leading keys are in ``known`` (the bench's hits, when ``known``
    is what the cache holds)."""
    head = 0
    while head < len(keys) and keys[head] in known:
        head += 1
    return head


def infinite_hit_rate(trace: Trace) -> float:
    """The bench's hit rate with room for every block: per request, the leading keys that
    an earlier request had."""
    seen: set[bytes] = set()
    hits = total = 0
    for keys in trace.requests:
        head = _known_head(keys, seen)
        hits, total = hits + head, total + len(keys)
        seen.update(keys)
    return hits / total if total else 0.0


def admission_oracle(trace: Trace) -> list[list[bool]]:
    """Per request, per key: whether a later request names the key. An admission filter
    that knew the future would store these and no others (`_Ours`'s ``admit``)."""
    ahead: Counter[bytes] = Counter()
    for keys in trace.requests:
        ahead.update(dict.fromkeys(keys, 1))
    masks = []
    for keys in trace.requests:
        ahead.subtract(dict.fromkeys(keys, 1))
        masks.append([ahead[key] > 0 for key in keys])
    return masks


def _store_features(trace: Trace) -> list[list[tuple[int, int, int, bool]]]:
    """Per request, per key, what a filter can know when the key is stored: the requests
    that named it before (0-3, 3 for more), how many of the request's leading keys an
    earlier request named (0, 1-3, 4-15, 16 or more: how far its history goes), how many
    of its keys no earlier request named (0-3, 4-15, 16-47, 48 or more), and whether it is
    the request's last key (a prompt's partial block)."""
    named: Counter[bytes] = Counter()
    features = []
    for keys in trace.requests:
        head = _known_head(keys, named)
        fresh = len(keys) - head
        history = 0 if head == 0 else 1 if head < 4 else 2 if head < 16 else 3
        size = 0 if fresh < 4 else 1 if fresh < 16 else 2 if fresh < 48 else 3
        last = len(keys) - 1
        features.append(
            [(min(named[key], 3), history, size, at == last) for at, key in enumerate(keys)]
        )
        named.update(dict.fromkeys(keys, 1))
    return features


def fitted_admission(trace: Trace, oracle: list[list[bool]]) -> dict[float, list[list[bool]]]:
    """Admission filters fitted to ``trace`` itself (so better than any filter could do on
    traffic it has not seen): per threshold in `ADMISSION_THRESHOLDS`, store a key when
    the share of the keys with its `_store_features` that a later request names (the
    ``oracle``) is at least the threshold. Threshold 0 admits every key."""
    features = _store_features(trace)
    named_again: Counter[tuple[int, int, int, bool]] = Counter()
    seen: Counter[tuple[int, int, int, bool]] = Counter()
    for request, again in zip(features, oracle):
        seen.update(request)
        named_again.update(itertools.compress(request, again))
    share = {feature: named_again[feature] / count for feature, count in seen.items()}
    return {
        threshold: [[share[feature] >= threshold for feature in request] for request in features]
        for threshold in ADMISSION_THRESHOLDS
    }


def admission_hit_rates(
    trace: Trace,
    capacity: int,
    oracle: list[list[bool]],
    fitted: dict[float, list[list[bool]]],
    lru: float | None = None,
) -> tuple[float, float, float]:
    """Our ``lru`` (vLLM's LRU decisions) behind an admission filter: its hit rate with the
    ``oracle``'s, and the best with a ``fitted`` one, with that filter's threshold. What
    lies between them and the plain LRU is the room that admission of new blocks has, and
    how much of it what is known at store time can take. ``lru``: the plain LRU's hit rate
    when the caller has it, which the threshold-0 filter (every key admitted) then is
    without a replay."""

    def replay(mask: list[list[bool]]) -> float:
        return _drive(_Ours("lru", False, capacity, mask), trace).hit_rate

    best, threshold = max(
        (lru if threshold == 0 and lru is not None else replay(mask), threshold)
        for threshold, mask in fitted.items()
    )
    return replay(oracle), best, threshold


def _policy_case(
    case: str,
    policy: str,
    touch: bool,
    reference: str,
    trace: Trace,
    repeats: int,
    with_vllm: bool,
    say: Callable[[str], None],
) -> list[BenchRecord]:
    """Ours with ``policy`` against vLLM's manager with ``reference``, interleaved."""
    makers: list[Callable[[], _Driver]] = [functools.partial(_Ours, policy, touch, trace.capacity)]
    if with_vllm:
        makers.append(functools.partial(_VLLM, reference, touch, trace.capacity, trace))
    say(f"ledger: {case}: ours{' and vLLM, interleaved' if with_vllm else ''}")
    results = _interleaved(makers, trace, repeats)
    name = VLLM_NAME if reference == policy else VLLM_ARC_NAME
    return _records(case, TARGETS[policy], results[0], results[1] if with_vllm else None, name)


def _sweep(
    traces: dict[str, Trace], with_vllm: bool, say: Callable[[str], None]
) -> list[BenchRecord]:
    """prefix's hit rate against vLLM's ARC per (trace, capacity), with our LRU and Belady's
    optimum beside it, and `NEW_POLICY`'s against the better of vLLM's LRU and ARC; then
    the mean of prefix's ratios."""
    records: list[BenchRecord] = []
    ratios: list[float] = []
    reference_name = VLLM_ARC_NAME if with_vllm else None
    for name, trace in traces.items():
        for fraction in SWEEP_FRACTIONS:
            capacity = trace.capacity_at(fraction)
            case = f"{name}@{fraction:.0%}"
            say(f"ledger: sweep {case}: {len(trace.requests)} requests, capacity {capacity}")
            arc = None
            if with_vllm:
                arc = _drive(_VLLM("arc", False, capacity, trace), trace).hit_rate
            rates = {
                policy: _drive(_Ours(policy, False, capacity), trace).hit_rate
                for policy in ("lru", *OTHER_POLICIES, NEW_POLICY)
            }
            for policy in ("prefix", "lru"):
                target = 1.0 if policy == "prefix" and arc is not None else None
                records.append(
                    _hit_rate(f"{policy}/{case}", rates[policy], arc, reference_name, target)
                )
            if arc is not None:
                ratios.append(rates["prefix"] / arc)
            best = None if arc is None else max(arc, rates["lru"])  # our lru: vLLM's decisions
            for policy in OTHER_POLICIES[1:]:
                records.append(
                    _hit_rate(
                        f"{policy}/{case}",
                        rates[policy],
                        best,
                        None if best is None else VLLM_BEST_NAME,
                        None,
                    )
                )
            records.append(
                _hit_rate(
                    f"{NEW_POLICY}/{case}",
                    rates[NEW_POLICY],
                    best,
                    None if best is None else VLLM_BEST_NAME,
                    None if best is None else FLOOR_TARGET,
                )
            )
            optimum = belady_hit_rate(trace, capacity)
            records.append(_hit_rate(f"belady/{case}", optimum, arc, reference_name, None))
    if ratios:
        mean = statistics.fmean(ratios)
        records.append(
            throughput_record(
                "ledger",
                "prefix/sweep",
                "hit_rate_ratio_mean",
                mean,
                reference=1.0,
                reference_name=reference_name,
                target=SWEEP_TARGET,
                unit="x",
            )
        )
    return records


def _hit_rate(
    case: str, ours: float, reference: float | None, name: str | None, target: float | None
) -> BenchRecord:
    return throughput_record(
        "ledger", case, "hit_rate", ours, reference=reference, reference_name=name, target=target
    )


def belady_hit_rate(trace: Trace, capacity: int) -> float:
    """The bench's hit rate when each eviction takes the key used again furthest in the
    future (Belady's MIN, offline: it reads the whole trace), stores made as the bench makes
    them (the keys after the first miss), a request's own keys never evicted for it."""
    uses: defaultdict[bytes, list[int]] = defaultdict(list)
    for index, keys in enumerate(trace.requests):
        for key in keys:
            uses[key].append(index)
    never = len(trace.requests)
    cursor: defaultdict[bytes, int] = defaultdict(int)

    def next_use(key: bytes, now: int) -> int:
        times, i = uses[key], cursor[key]
        while i < len(times) and times[i] <= now:
            i += 1
        cursor[key] = i
        return times[i] if i < len(times) else never

    held: dict[bytes, int] = {}  # key -> its next use
    heap: list[tuple[int, bytes]] = []  # (-next use, key), stale entries skipped
    hits = total = 0
    for now, keys in enumerate(trace.requests):
        head = _known_head(keys, held)
        hits, total = hits + head, total + len(keys)
        for key in keys:
            if key in held:
                held[key] = next_use(key, now)
                heapq.heappush(heap, (-held[key], key))
        new = [key for key in dict.fromkeys(keys) if key not in held]
        if len(held) + len(new) > capacity:
            mine, skipped = set(keys), []
            while len(held) + len(new) > capacity and heap:
                entry = heapq.heappop(heap)
                key = entry[1]
                if held.get(key) != -entry[0]:
                    continue
                if key in mine:
                    skipped.append(entry)
                else:
                    del held[key]
            for entry in skipped:
                heapq.heappush(heap, entry)
            if len(held) + len(new) > capacity:
                continue  # no room: the bench's ledger refuses the store too
        for key in new:
            held[key] = next_use(key, now)
            heapq.heappush(heap, (-held[key], key))
    return hits / total if total else 0.0


def _records(
    case: str, ops_target: float, ours: _Result, ref: _Result | None, name: str = VLLM_NAME
) -> list[BenchRecord]:
    def rec(metric: str, target: float | None, unit: str) -> BenchRecord:
        value: Any = getattr(ours, metric)
        reference = None if ref is None else getattr(ref, metric)
        return throughput_record(
            "ledger",
            case,
            metric,
            value,
            reference=reference,
            reference_name=None if ref is None else name,
            target=None if ref is None else target,
            unit=unit,
        )

    return [
        rec("ops_per_s", ops_target, "ops/s"),
        rec("keys_per_s", None, "keys/s"),
        rec("hit_rate", 1.0, ""),
    ]
