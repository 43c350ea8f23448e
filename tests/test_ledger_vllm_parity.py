"""Differential test: our primary ledger and vLLM 0.33's ``CPUOffloadingManager``, side by side.

Hypothesis writes serving-like traces: a few documents whose blocks chain like vLLM's prefix
hashes, requests that read a prefix of one of them plus a suffix of their own, in one or two
KV groups, interleaved by a drawn schedule. A request looks its keys up to the first miss,
loads the hits (the load completes later), stores the rest in one to three batches (each
completing later, some failing; a refused batch is offered up to twice more), sometimes
offering its hits too or offering everything once more at the end (a preempted request
resuming), and finishes, possibly before its stores complete. Some requests are
anonymous on our side (``req=None``: every call a request of its own), matched on vLLM's by a
fresh ``ReqContext`` per call, finished at once. The two call patterns are vLLM 0.33's
scheduler (no ``touch``) and the classic one (``touch`` of the hits, or of all the request's
keys, before the load).

Every answer must be identical, in order: lookups, load slots, keys to store, store slots,
evicted keys (and None against not None), and the events after each step.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from kvtier_async.ledger import PrimaryLedger, make_offload_key

pytestmark = pytest.mark.vllm

TOKENS_PER_CHUNK = 16
PARITY = settings(
    max_examples=500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module", autouse=True)
def _vllm() -> None:
    """Import vLLM's manager once, silencing the deprecation warnings torch raises on the way
    (pytest turns warnings into errors)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        pytest.importorskip("vllm.v1.kv_offload.cpu.manager")


# --- traces -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    keys: tuple[tuple[bytes, ...], ...]  # per KV group, per chunk (head -> tail)
    cuts: tuple[int, ...]  # chunk indices splitting the store range into batches
    outcomes: tuple[bool, ...]  # per batch: the write succeeds
    offer_all: bool  # offer the whole prefix, hits included (request-level)
    again: bool  # then offer it all once more (a preempted request resuming)
    touch_all: bool  # the touch pattern touches all the request's keys, not only the hits
    anonymous: bool

    @property
    def chunks(self) -> int:
        return len(self.keys[0])


@dataclass(frozen=True)
class Trace:
    capacity: int
    threshold: int
    tracker: int  # max_tracker_size of the admission counts
    requests: tuple[Request, ...]
    schedule: tuple[int, ...]


def _chain(name: str, n: int, parent: bytes = b"") -> list[bytes]:
    h = hashlib.sha256(parent + name.encode()).digest()
    hashes = []
    for i in range(n):
        h = hashlib.sha256(h + bytes([i])).digest()[:8]
        hashes.append(h)
    return hashes


@st.composite
def traces(draw: st.DrawFn) -> Trace:
    groups = draw(st.integers(1, 2))
    docs = [_chain(f"doc{d}", draw(st.integers(1, 6))) for d in range(draw(st.integers(1, 2)))]
    requests = []
    for r in range(draw(st.integers(1, 12))):
        doc = docs[draw(st.integers(0, len(docs) - 1))]
        prefix = doc[: draw(st.integers(0, len(doc)))]
        parent = prefix[-1] if prefix else b""
        hashes = prefix + _chain(f"req{r}", draw(st.integers(0 if prefix else 1, 3)), parent)
        keys = tuple(tuple(make_offload_key(h, g) for h in hashes) for g in range(groups))
        cuts = draw(st.lists(st.integers(0, len(hashes)), max_size=2))
        outcomes = draw(st.lists(st.integers(0, 4).map(bool), min_size=3, max_size=3))
        requests.append(
            Request(
                keys,
                tuple(sorted(cuts)),
                tuple(outcomes),
                offer_all=draw(st.integers(0, 3)) == 0,
                again=draw(st.integers(0, 3)) == 0,
                touch_all=draw(st.booleans()),
                anonymous=draw(st.integers(0, 4)) == 0,
            )
        )
    unique = len({key for req in requests for group in req.keys for key in group})
    return Trace(
        capacity=draw(st.integers(max(1, unique // 5), max(1, unique * 2 // 3))),
        threshold=draw(st.sampled_from([1, 2])),
        tracker=draw(st.sampled_from([2, 5, 64_000])),
        requests=tuple(requests),
        schedule=tuple(draw(st.lists(st.integers(0, 63), min_size=20, max_size=150))),
    )


# --- the two sides ------------------------------------------------------------------------

StoreAnswer = tuple[list[bytes], list[int], list[bytes]] | None


class VLLMSide:
    """vLLM's manager, called the way its connector's scheduler calls it."""

    def __init__(self, trace: Trace, policy: str) -> None:
        from vllm.v1.kv_offload.base import ReqContext
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        self._context = ReqContext
        self.manager = CPUOffloadingManager(
            trace.capacity,
            cache_policy=policy,
            enable_events=True,
            store_threshold=trace.threshold,
            max_tracker_size=trace.tracker,
        )
        self.contexts: dict[int, Any] = {}
        self.idle = ReqContext(req_id="idle")

    def begin(self, req: int, request: Request) -> None:
        ctx = self._context(req_id=str(req))
        for group in request.keys:
            for chunk, key in enumerate(group, 1):
                ctx.set_offload_key_position(key, chunk * TOKENS_PER_CHUNK)
        self.manager.on_new_request(ctx)
        self.contexts[req] = ctx

    def _call(self, req: int | None, keys: Sequence[bytes], fn: Callable[[Any], Any]) -> Any:
        if req is not None:
            return fn(self.contexts[req])
        ctx = self._context(req_id="anonymous")  # a one-call request, positions by index
        for position, key in enumerate(keys, 1):
            ctx.set_offload_key_position(key, position)
        self.manager.on_new_request(ctx)
        answer = fn(ctx)
        self.manager.on_request_finished(ctx)
        return answer

    def lookup(self, key: bytes) -> str:
        return str(self.manager.lookup(key, self.idle).name)

    def prepare_load(self, keys: list[bytes], req: int | None) -> list[int]:
        spec = self._call(req, keys, lambda ctx: self.manager.prepare_load(keys, ctx))
        return [int(i) for i in spec.block_ids]

    def complete_load(self, keys: list[bytes]) -> None:
        self.manager.complete_load(keys, self.idle)

    def touch(self, keys: list[bytes], req: int | None) -> None:
        self._call(req, keys, lambda ctx: self.manager.touch(keys, ctx))

    def prepare_store(self, keys: list[bytes], req: int | None) -> StoreAnswer:
        out = self._call(req, keys, lambda ctx: self.manager.prepare_store(keys, ctx))
        if out is None:
            return None
        slots = [int(i) for i in out.store_spec.block_ids]
        return list(out.keys_to_store), slots, list(out.evicted_keys)

    def complete_store(self, keys: list[bytes], success: bool) -> None:
        self.manager.complete_store(keys, self.idle, success)

    def finish(self, req: int) -> None:
        self.manager.on_request_finished(self.contexts.pop(req))

    def events(self) -> list[tuple[tuple[bytes, ...], bool, bool]]:
        return [(tuple(e.keys), e.removed, e.metadata_only) for e in self.manager.take_events()]


class OurSide:
    def __init__(self, trace: Trace, policy: str) -> None:
        self.ledger = PrimaryLedger(
            trace.capacity,
            policy=policy,
            store_threshold=trace.threshold,
            max_tracker_size=trace.tracker,
        )

    def begin(self, req: int, request: Request) -> None:
        for group in request.keys:
            self.ledger.note_positions(req, group)

    def lookup(self, key: bytes) -> str:
        return self.ledger.lookup(key).name

    def prepare_load(self, keys: list[bytes], req: int | None) -> list[int]:
        return [int(i) for i in self.ledger.prepare_load(keys, req).slot_ids]

    def complete_load(self, keys: list[bytes]) -> None:
        self.ledger.complete_load(keys)

    def touch(self, keys: list[bytes], req: int | None) -> None:
        self.ledger.touch(keys, req)

    def prepare_store(self, keys: list[bytes], req: int | None) -> StoreAnswer:
        out = self.ledger.prepare_store(keys, req)
        if out is None:
            return None
        return list(out.keys_to_store), [int(i) for i in out.store_spec.slot_ids], out.evicted_keys

    def complete_store(self, keys: list[bytes], success: bool) -> None:
        self.ledger.complete_store(keys, success)

    def finish(self, req: int) -> None:
        self.ledger.request_finished(req)

    def events(self) -> list[tuple[tuple[bytes, ...], bool, bool]]:
        return [(tuple(e.keys), e.removed, e.metadata_only) for e in self.ledger.take_events()]


# --- the replay ---------------------------------------------------------------------------


@dataclass(eq=False)
class Job:
    kind: str
    keys: list[bytes]
    success: bool
    done: bool = False


@dataclass
class Replay:
    """Drives both sides with the same calls and checks every answer."""

    trace: Trace
    touch: bool
    sides: tuple[Any, Any]
    jobs: list[Job] = field(default_factory=list)  # in flight, oldest first
    log: list[str] = field(default_factory=list)

    def both(self, what: str, call: Callable[[Any], Any]) -> Any:
        ours, theirs = (call(side) for side in self.sides)
        self.log.append(f"{what} -> {theirs}")
        assert ours == theirs, f"{what}: ours {ours!r}, vLLM {theirs!r}\n" + "\n".join(self.log)
        return ours

    def request(self, index: int) -> Iterator[Job | None]:
        """One request's calls; yields after each step (a load job: wait for it)."""
        request = self.trace.requests[index]
        req = None if request.anonymous else index
        if req is not None:
            for side in self.sides:
                side.begin(req, request)
        hits = self.lookup(request)
        if self.touch:
            end = request.chunks if request.touch_all else hits
            touched = [key for group in request.keys for key in group[:end]]
            self.both(f"r{index} touch {end}", lambda s: s.touch(touched, req))
        if hits:
            keys = [key for group in request.keys for key in group[:hits]]
            self.both(f"r{index} prepare_load {len(keys)}", lambda s: s.prepare_load(keys, req))
            load = Job("load", keys, True)
            self.jobs.append(load)
            yield load  # vLLM runs the request once its load is done
        start = 0 if request.offer_all else hits
        bounds = sorted({start, request.chunks, *(c for c in request.cuts if start < c)})
        batches = list(itertools.pairwise(bounds))
        if request.again:
            batches.append((0, request.chunks))
        for batch, (lo, hi) in enumerate(batches):
            offer = [key for group in request.keys for key in group[lo:hi]]
            for attempt in range(3):  # a refused offer is made again at a later step
                what = f"r{index} prepare_store [{lo}:{hi}] try {attempt}"
                out = self.both(what, lambda s, offer=offer: s.prepare_store(offer, req))
                if out is not None:
                    if out[0]:
                        self.jobs.append(Job("store", out[0], request.outcomes[batch % 3]))
                    break
                yield None
            yield None
        if req is not None:
            self.both(f"r{index} finish", lambda s: s.finish(req))

    def lookup(self, request: Request) -> int:
        """Leading chunks whose keys are HITs in every group (vLLM stops at a miss)."""
        hits = 0
        for chunk in range(request.chunks):
            keys = [group[chunk] for group in request.keys]
            answers = [self.both("lookup", lambda s, key=key: s.lookup(key)) for key in keys]
            if any(answer != "HIT" for answer in answers):
                break
            hits += 1
        return hits

    def complete(self, job: Job) -> None:
        self.jobs.remove(job)
        job.done = True
        if job.kind == "load":
            self.both("complete_load", lambda s: s.complete_load(job.keys))
        else:
            what = f"complete_store {job.success}"
            self.both(what, lambda s: s.complete_store(job.keys, job.success))

    def run(self) -> None:
        """Each step, the schedule picks one of: complete a job in flight, advance a running
        request (not waiting for its load), start the next request; past its end, the first."""
        running: dict[int, tuple[Iterator[Job | None], Job | None]] = {}
        waiting = list(range(len(self.trace.requests)))
        choices = iter(self.trace.schedule)
        while waiting or running or self.jobs:
            steps = [functools.partial(self.complete, job) for job in self.jobs]
            for index, (_, load) in running.items():
                if load is None or load.done:
                    steps.append(functools.partial(self.advance, running, index))
            if waiting:
                steps.append(functools.partial(self.start, running, waiting.pop, 0))
            steps[next(choices, 0) % len(steps)]()
            self.both("events", lambda s: s.events())

    def start(self, running: dict[int, Any], pop: Callable[[int], int], at: int) -> None:
        index = pop(at)
        running[index] = (self.request(index), None)
        self.advance(running, index)

    def advance(self, running: dict[int, Any], index: int) -> None:
        steps, _ = running[index]
        try:
            running[index] = (steps, next(steps))
        except StopIteration:
            del running[index]


@pytest.mark.parametrize("touch", [False, True], ids=["vllm-pattern", "touch-pattern"])
@pytest.mark.parametrize("policy", ["lru", "arc"])
@PARITY
@given(trace=traces())
def test_same_decisions_as_vllm(policy: str, touch: bool, trace: Trace) -> None:
    sides = (OurSide(trace, policy), VLLMSide(trace, policy))
    Replay(trace, touch, sides).run()


@pytest.mark.parametrize("case", ["lru", "arc", "lru-touch", "arc-touch"])
def test_bench_trace_hit_rates_match(case: str) -> None:
    """The ``ledger`` benchmark's drivers, on a small trace: the same hit rate."""
    from kvtier_async.bench import ledger as bench

    trace = bench.make_trace(num_docs=20, num_requests=200, seed=3)
    policy, touch = bench.CASES[case]
    ours = bench._drive(bench._Ours(policy, touch, trace.capacity), trace)
    theirs = bench._drive(bench._VLLM(policy, touch, trace.capacity, trace), trace)
    assert 0 < ours.hit_rate == theirs.hit_rate
