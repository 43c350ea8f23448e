"""The vLLM connector in vLLM 0.33's real Scheduler with its secondary tier failing mid-run.

`vllm_kit`'s harness (``tests/kits``) runs the real Scheduler and a fake model whose K/V
bytes are known per token prefix: its attention checks every byte of context it reads (cache
hits and loads alike) and raises `KVMismatch` on the first wrong one. Our connector has a
CPU tier of 8 blocks and one secondary tier, so blocks are cascaded and promoted all the time.
Three faults, each begun after a few steps and ended a few seconds later while the trace goes
on (a second wave of requests arrives after it, the last ones with prompts of their own, so
stores reach the tier again):

- the obj tier's S3 server hung (its port taken by `_s3.SilentServer`);
- the obj tier's S3 server stopped (connections refused);
- the fs tier's root replaced by a regular file (every store and load fails).

Every step (``schedule`` + ``update_from_output``, and the whole step with the model's worker
hooks) is timed: the scheduler never waits on the tier, so each must stay under `BOUND_S`.
Every request must finish with the tokens of a run without any connector (the fake model
checked the KV bytes behind them), the harness must see no leak, and closing (both roles'
``shutdown``) is timed too. The recovery is the time from the end of the fault until a
cascade reached the tier again. Two more runs: the hung case with a ``reset_prefix_cache``
while tier jobs wait on the server (the connector's reset drains the tiers, within
``wait_timeout_s``), and a shutdown while cascades wait for PUTs the server never answers.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from faults._common import DISK, Calls, Row, fs_tier, guard, private_dir
from faults._net import DelayProxy
from faults.s3_outage import RECOVERY_BOUND_S, Outage, Refused, SilentPort, WritesHang
from kvtier_async.bench.s3server import MotoS3Server
from kvtier_async.ledger import JobKind

BOUND_S = 2.0  # a step waits on no tier: bookkeeping and the fake model, on a busy 2-core box
STEP_FLOOR_S = 0.002  # the shortest step: a real engine's step takes milliseconds
CLOSE_BOUND_S = 5.0  # shutdown: the tier engine's close, its tier's close within timeout_s
TIMEOUT_S = 1.0  # the obj tier's
WAIT_TIMEOUT_S = 5.0  # the connector's wait_timeout_s: how long a reset waits for the tiers
RESET_BOUND_S = WAIT_TIMEOUT_S + 2.0  # with 2 s for a busy machine
FAULT_AT = 8  # steps before the fault begins
FAULT_S = 4.0  # how long it lasts
BOUNDS = (
    f"vLLM steps: {BOUND_S:g} s (a step waits on no tier); shutdown {CLOSE_BOUND_S:g} s; "
    f"reset_prefix_cache: wait_timeout_s ({WAIT_TIMEOUT_S:g} s) + 2 s = {RESET_BOUND_S:g} s; "
    "recovery: S3 as above plus a step, fs 2 steps' bound"
)
OUTER_S = 120.0  # a run still going then fails the row
WAVE = 24  # requests before the fault's end; the rest arrive after it
PROBE = "probe-"  # requests added after the trace until a block reaches the tier again


class RootReplaced(Outage):
    """The fs root moved away and a regular file put in its place."""

    name = "vLLM connector: fs root replaced by a file mid-run"

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def _begin(self) -> None:
        self.root.rename(self.root.with_name("away"))
        self.root.write_bytes(b"not a directory")

    def _end(self) -> None:
        self.root.unlink()
        self.root.with_name("away").rename(self.root)


def run(seed: int) -> Iterator[Row]:
    import vllm_harness as vh

    rng = random.Random(f"{seed}-fresh")
    fresh = [(f"fresh-{i}", vh.random_tokens(rng, 100), 2) for i in range(4)]
    trace = vh.shared_prefix_requests(seed=seed, num_requests=40) + fresh  # new blocks last
    with vh.VllmHarness(num_gpu_blocks=48, max_num_batched_tokens=256) as h:
        h.drive(trace, per_step=2)
        baseline = dict(h.stats.outputs)
    # moto in a process of its own: a lookup then gets its answer within its 1 s deadline
    # while this process steps the engine (a late one would open the breaker before any PUT)
    with MotoS3Server(in_process=False) as server, DelayProxy(server.port) as proxy:
        bucket = f"vllm-{uuid.uuid4().hex[:12]}"
        server.create_bucket(bucket)
        tier = server.tier_config(bucket, timeout_s=TIMEOUT_S, endpoint_override=proxy.endpoint)
        yield shutdown_while_hung(WritesHang(server, proxy), tier, trace)
    for make, reset in ((SilentPort, False), (SilentPort, True), (Refused, False)):
        with MotoS3Server() as server:
            fault = make(server)
            bucket = f"vllm-{uuid.uuid4().hex[:12]}"
            server.create_bucket(bucket)
            tier = server.tier_config(bucket, timeout_s=TIMEOUT_S)
            title = f"vLLM connector: {fault.name} mid-run"
            if reset:
                title = f"vLLM connector: reset_prefix_cache while {fault.name[3:]}"
            yield trial(title, fault, tier, trace, baseline, RECOVERY_BOUND_S + BOUND_S, reset)
    parent = private_dir(DISK, "vllm")
    try:
        root = parent / "root"
        fault = RootReplaced(root)
        yield trial(fault.name, fault, fs_tier(root), trace, baseline, 2 * BOUND_S)
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def trial(
    title: str,
    fault: Outage,
    tier: dict[str, Any],
    trace: list[Any],
    baseline: dict[str, Any],
    recovery_bound_s: float,
    reset: bool = False,
) -> Row:
    """The trace with the fault mid-run (and, with ``reset``, a ``reset_prefix_cache`` in
    the middle of the fault: it waits for the tiers, within ``wait_timeout_s``)."""
    import vllm_harness as vh
    from test_vllm_connector import ours

    bound = RESET_BOUND_S if reset else BOUND_S
    row = Row(title, bound_s=bound, recovery_bound_s=recovery_bound_s, bounds=[BOUNDS])
    calls = Calls(row)
    config = ours(secondary_tiers=[tier], cpu_bytes_to_use=8 * 4096, wait_timeout_s=WAIT_TIMEOUT_S)
    with guard(row), contextlib.ExitStack() as stack:
        h = vh.VllmHarness(num_gpu_blocks=48, max_num_batched_tokens=256,
                           kv_load_failure_policy="recompute", **config)  # fmt: skip
        stack.callback(fault.end)
        try:
            drive(row, calls, h, fault, trace, reset)
        except vh.KVMismatch as exc:
            row.wrong_bytes += 1  # at least: the fake model stops at the first wrong byte
            row.problems.append(f"wrong KV bytes loaded: {exc}")
        finally:
            closing = time.monotonic()
            h.close()
            closed = time.monotonic() - closing
        outputs = {r: t for r, t in h.stats.outputs.items() if not r.startswith(PROBE)}
        probes = len(h.stats.outputs) - len(outputs)
        extra = f" (+{probes} after the trace until a block reached the tier)" if probes else ""
        row.notes.append(f"{len(outputs)} requests{extra}; shutdown took {closed:.2f} s")
        if closed > CLOSE_BOUND_S:
            row.problems.append(f"shutdown took {closed:.2f} s, bound {CLOSE_BOUND_S:g} s")
        row.trials = len(outputs)
        wrong = {r for r, tokens in outputs.items() if tokens != baseline[r]}
        if wrong or len(outputs) != len(baseline):
            row.problems.append(f"{len(wrong)} requests gave other tokens than without a connector")
        row.problems += h.leaks()
    return row


def shutdown_while_hung(fault: Outage, tier: dict[str, Any], trace: list[Any]) -> Row:
    """Shutdown while cascades wait for PUTs the S3 server never answers."""
    import vllm_harness as vh
    from test_vllm_connector import ours

    row = Row("vLLM connector: shutdown while S3 PUTs hang", bound_s=CLOSE_BOUND_S, bounds=[BOUNDS])
    config = ours(secondary_tiers=[tier], cpu_bytes_to_use=8 * 4096)
    with guard(row), contextlib.ExitStack() as stack:
        h = vh.VllmHarness(num_gpu_blocks=48, max_num_batched_tokens=256,
                           kv_load_failure_policy="recompute", **config)  # fmt: skip
        stack.callback(fault.end)
        try:
            h.drive(trace[:4], per_step=2)
            for item in trace[4:12]:
                h.add_request(*item)
            ends = time.monotonic() + OUTER_S
            timed_step(Calls(row), h)  # their lookups go out (reads are not the fault here)
            while looking_up(h) and time.monotonic() < ends:
                timed_step(Calls(row), h)
            fault.begin()  # then their stores' cascades meet PUTs that are never answered
            while not hung(h, fault) and time.monotonic() < ends:
                timed_step(Calls(row), h)  # until cascades wait for the hung server
            row.trials = len(trace[:12])
            if not hung(h, fault):
                row.problems.append("no cascade was in flight at shutdown")
        finally:
            closing = time.monotonic()
            h.close()
            Calls(row).record("shutdown", time.monotonic() - closing)
    return row


def hung(h: Any, fault: Outage) -> bool:
    """A cascade is out, or a PUT is held by the proxy (its cascade may have failed already
    if other requests opened the tier's breaker: the request itself still hangs)."""
    proxy = getattr(fault, "proxy", None)
    return cascading(h) or (proxy is not None and proxy.held > 0)


def looking_up(h: Any) -> bool:
    outstanding = h.connector.scheduler.ledger.outstanding()
    return any(task.kind is JobKind.LOOKUP for task in outstanding)


def cascading(h: Any) -> bool:
    outstanding = h.connector.scheduler.ledger.outstanding()
    return any(task.kind is JobKind.CASCADE for task in outstanding)


def drive(
    row: Row, calls: Calls, h: Any, fault: Outage, trace: list[Any], reset: bool = False
) -> None:
    """The trace, two arrivals per step, with the fault from step `FAULT_AT` for `FAULT_S`
    (and a reset half-way through it); the requests past `WAVE` arrive after it ended. Then
    steps until no work is pending and a block reached the tier after the fault (new prompts
    of their own arrive until then, within the row's recovery bound)."""
    import vllm_harness as vh

    arrivals: Iterator[Any] = iter(trace[:WAVE])
    rng, probes = random.Random(f"{len(trace)}-probes"), 0
    counters = h.connector.scheduler.ledger.counters[0]
    began = ended = None
    cascaded_at_end = 0
    started = time.monotonic()
    for step in itertools.count():
        now = time.monotonic()
        if now - started > OUTER_S:
            row.problems.append(f"the run did not end within {OUTER_S:g} s")
            return
        if step == FAULT_AT:
            fault.begin()
            began = now
        elif began is not None and ended is None and now - began > FAULT_S:
            fault.end()
            ended, cascaded_at_end = now, counters.cascaded
            arrivals = itertools.chain(arrivals, trace[WAVE:])
        if ended is not None and row.recovery_s is None and counters.cascaded > cascaded_at_end:
            row.recovery_s = now - ended
        outstanding = len(h.connector.scheduler.ledger.outstanding())
        if reset and began is not None and (outstanding or now - began > FAULT_S / 2):
            reset = False  # once, while tier jobs wait for the hung server if there are any
            resetting = time.monotonic()
            h.scheduler.reset_prefix_cache(reset_connector=True)
            took = time.monotonic() - resetting
            calls.record("reset_prefix_cache", took)
            row.notes.append(f"reset_prefix_cache with {outstanding} tier jobs out: {took:.2f} s")
        for item in itertools.islice(arrivals, 2):
            h.add_request(*item)
        pending = h.has_work() or h.connector.has_pending_push_work()
        if ended is not None and not pending:
            if row.recovery_s is not None:
                return
            if now - ended > (row.recovery_bound_s or 0.0):
                row.problems.append("no block reached the tier after the fault ended")
                return
            # The trace is done but the tier has not taken a block yet (its breaker may wait
            # for its next probe): new prompts keep coming, as in service, one at a time.
            probes += 1
            h.add_request(f"{PROBE}{probes}", vh.random_tokens(rng, 100), 2)
            pending = True
        if not pending:
            time.sleep(0.005)  # an idle engine core waits for work; it does not spin
        timed_step(calls, h)


def timed_step(calls: Calls, h: Any) -> None:
    """One step, timed; past `BOUND_S` it fails the row whatever the row's bound."""
    began = time.monotonic()
    h.step()
    for name, seconds in (
        ("engine step (scheduler + worker hooks)", time.monotonic() - began),
        ("scheduler step", h.stats.step_seconds[-1]),
    ):
        calls.record(name, seconds)
        if seconds > BOUND_S:
            calls.row.problems.append(f"a {name} took {seconds:.2f} s, bound {BOUND_S:g} s")
    # A GPU step takes milliseconds; the fake model's take ~0.1 ms, and stepping that fast
    # would starve of the GIL the S3 server and proxy threads this process also runs (a
    # lookup then times out on our side of the wire, not the server's).
    rest = STEP_FLOOR_S - (time.monotonic() - began)
    if rest > 0:
        time.sleep(rest)
