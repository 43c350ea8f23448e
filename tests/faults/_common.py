"""What every fault scenario shares: the table row, a clock for public calls, blocks whose
bytes are known from their key, and the checks that count wrong bytes and lost blocks.

A block's bytes are a function of its key (`content`), so any process (a restarted one, a
reader beside two writers) can check every byte it is handed without being told what was
stored. "Durable" means what the cache itself confirmed: after `TieredKVCache.drain`, the
keys of the cache's STORAGE events for a tier (`Watched.take_durable`).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
import numpy as np
import numpy.typing as npt
from anyio.streams.memory import MemoryObjectReceiveStream

from kvtier_async.api import TieredKVCache
from kvtier_async.events import BlockRemoved, BlockStored, KVEvent
from kvtier_async.ledger import make_offload_key

T = TypeVar("T")
Bytes = npt.NDArray[np.uint8]

SENTINEL = 0xA5  # what a destination block holds before a load


# -- the table row -------------------------------------------------------------------------


@dataclass
class Row:
    """One line of the table. ``bound_s``: the longest any public call may block under this
    fault; ``recovery_s``: from the end of the fault until the tier took a store again (None:
    the fault has no end to recover from); ``bounds``: where those bounds come from;
    ``problems``: any other check that failed (the row fails); ``notes``: what was found that
    is none of these (reported, the row passes)."""

    fault: str
    trials: int = 0
    wrong_bytes: int = 0
    durable_lost: int = 0
    longest_s: float = 0.0
    longest_call: str = ""
    bound_s: float = math.inf
    recovery_s: float | None = None
    recovery_bound_s: float | None = None
    bounds: list[str] = field(default_factory=list)
    skipped: str = ""
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def failures(self) -> list[str]:
        """Why this row fails the suite (empty: it passes; a skip passes, loudly)."""
        out = list(self.problems)
        if self.wrong_bytes:
            out.append(f"{self.wrong_bytes} wrong bytes served")
        if self.durable_lost:
            out.append(f"{self.durable_lost} durable blocks lost")
        if self.longest_s > self.bound_s:
            out.append(
                f"{self.longest_call or 'a call'} blocked {self.longest_s:.2f} s, "
                f"bound {self.bound_s:.2f} s"
            )
        bound = self.recovery_bound_s
        if self.recovery_s is not None and bound is not None and self.recovery_s > bound:
            out.append(f"recovery took {self.recovery_s:.2f} s, bound {bound:.2f} s")
        return [f"{self.fault}: {text}" for text in out]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["bound_s"] = None if math.isinf(self.bound_s) else self.bound_s
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Row:
        data = dict(data)
        if data.get("bound_s") is None:
            data["bound_s"] = math.inf
        return cls(**data)


# Where the bounds of the rows come from (printed under the table).
LOCAL_BOUNDS = (
    "local files and the CPU tier: 5 s per call (no network: an allowance for a busy 2-core "
    "machine)"
)
FS_RECOVERY = "fs recovery: 5 s (no breaker: the next store may succeed)"
KILL_BOUNDS = "restart after kill -9: 10 s for the open (region reclaimed, temporaries removed)"
S3_BOUNDS = "S3 without an outage: 10 s per call (a few requests to a local server)"


# -- timing public calls ---------------------------------------------------------------------


class Calls:
    """Wall time of every public call made while a fault is on; the longest one wins."""

    def __init__(self, row: Row) -> None:
        self.row = row

    def record(self, name: str, seconds: float) -> None:
        if seconds > self.row.longest_s:
            self.row.longest_s, self.row.longest_call = seconds, name

    async def __call__(self, name: str, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        started = time.monotonic()
        try:
            return await fn(*args)
        finally:
            self.record(name, time.monotonic() - started)


@contextlib.contextmanager
def deadline(row: Row, what: str, seconds: float) -> Iterator[anyio.CancelScope]:
    """An outer deadline on calls that should end long before it: past it they are
    cancelled (so the suite goes on) and the row fails. The cancelled call's own time is
    recorded by `Calls`."""
    with anyio.move_on_after(seconds) as scope:
        yield scope
    if scope.cancelled_caught:
        row.problems.append(f"{what} did not end within {seconds:g} s (cancelled)")


@contextlib.contextmanager
def guard(row: Row) -> Iterator[None]:
    """A trial that raises fails its row (with the traceback in the log) instead of ending
    the scenario."""
    try:
        yield
    except Exception as exc:
        traceback.print_exc()
        row.problems.append(f"raised {type(exc).__name__}: {exc}")


# -- blocks whose bytes are known ------------------------------------------------------------


def key_of(seed: object, index: int) -> bytes:
    """The offload key of block ``index`` of stream ``seed``."""
    return make_offload_key(hashlib.sha256(f"{seed}:{index}".encode()).digest(), 0)


def keys_of(seed: object, count: int, start: int = 0) -> list[bytes]:
    return [key_of(seed, i) for i in range(start, start + count)]


def content(key: bytes, size: int) -> Bytes:
    """The bytes of ``key``'s block: a function of the key only."""
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(key).digest()[:16], "little"))
    return np.frombuffer(rng.bytes(size), dtype=np.uint8)


def wrong_bytes(key: bytes, block: Bytes) -> int:
    """How many bytes of ``block`` differ from ``key``'s bytes."""
    return int(np.count_nonzero(block != content(key, block.nbytes)))


def empty_block(size: int) -> Bytes:
    return np.full(size, SENTINEL, dtype=np.uint8)


# -- the cache -------------------------------------------------------------------------------


def cache_config(block_bytes: int, num_slots: int, *tiers: dict[str, Any], **extra: Any) -> Any:
    """A `TieredKVCache` config with ``tiers`` as its secondary tiers."""
    return {
        "block_bytes": block_bytes,
        "num_slots": num_slots,
        "secondary_tiers": list(tiers),
        **extra,
    }


class Watched(TieredKVCache):
    """A `TieredKVCache` that listens to its own KV events (`TieredKVCache.events`) from open
    to close, so that a scenario can ask which blocks it confirmed stored in a tier, and which
    a tier deleted on its own (damaged blocks) and the cache announced."""

    _listener: Any = None
    _events: MemoryObjectReceiveStream[KVEvent] | None = None

    async def __aenter__(self) -> Watched:
        await super().__aenter__()
        self._seen: dict[tuple[str, bool], list[bytes]] = {}
        self._listener = self.events(buffer=1 << 20)
        self._events = await self._listener.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        try:
            if self._listener is not None:
                await self._listener.__aexit__(None, None, None)
        finally:
            await super().__aexit__(*exc_info)

    def take_durable(self, tier: str) -> set[bytes]:
        """Keys whose blocks reached ``tier`` (STORAGE events) since the last call."""
        return set(self._take(tier, removed=False))

    def take_removed(self, tier: str) -> list[bytes]:
        """Keys ``tier`` deleted on its own (STORAGE removals) since the last call."""
        return self._take(tier, removed=True)

    def _take(self, tier: str, *, removed: bool) -> list[bytes]:
        while self._events is not None:
            try:
                event = self._events.receive_nowait()
            except anyio.WouldBlock:
                break
            if isinstance(event, (BlockStored, BlockRemoved)) and event.medium == "STORAGE":
                keys = [make_offload_key(h, event.group_idx) for h in event.block_hashes]
                place = (str(event.tier), isinstance(event, BlockRemoved))
                self._seen.setdefault(place, []).extend(keys)
        if self.stats().events_dropped:
            raise AssertionError("the cache dropped KV events: what it confirmed is unknown")
        return self._seen.pop((tier, removed), [])


async def store(cache: TieredKVCache, keys: Sequence[bytes], calls: Calls | None = None) -> Any:
    """Store ``keys`` with their bytes (timed when ``calls`` is given)."""
    blocks = [content(key, cache.config.block_bytes) for key in keys]
    if calls is None:
        return await cache.store(keys, blocks)
    return await calls("store", cache.store, keys, blocks)


async def load_one(cache: TieredKVCache, key: bytes, calls: Calls | None = None) -> int | None:
    """Look ``key`` up and, if the cache has it, load it and count its wrong bytes; None for
    a miss."""
    lookup = cache.lookup if calls is None else _timed(calls, "lookup", cache.lookup)
    if await lookup([key]) == 0:
        return None
    block = empty_block(cache.config.block_bytes)
    load = cache.load if calls is None else _timed(calls, "load", cache.load)
    if await load([key], [block]) != 1:
        return None
    return wrong_bytes(key, block)


def _timed(calls: Calls, name: str, fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    async def call(*args: Any) -> T:
        return await calls(name, fn, *args)

    return call


@dataclass
class Audit:
    """What a check of many keys found."""

    wrong_bytes: int = 0
    present: set[bytes] = field(default_factory=set)

    def lost(self, durable: Iterable[bytes]) -> int:
        return sum(1 for key in durable if key not in self.present)


async def audit(
    cache: TieredKVCache,
    keys: Iterable[bytes],
    calls: Calls | None = None,
    found: Audit | None = None,
) -> Audit:
    """Clear the CPU tier, then look up and load every key from the secondary tiers (what
    was found so far is in ``found`` too, if the caller cuts this short)."""
    await (cache.reset() if calls is None else calls("reset", cache.reset))
    found = found if found is not None else Audit()
    for key in keys:
        wrong = await load_one(cache, key, calls)
        if wrong is not None:
            found.present.add(key)
            found.wrong_bytes += wrong
    return found


async def recover(
    cache: Watched, tier: str, calls: Calls, seed: str, ended: float, poll_s: float = 0.05
) -> float:
    """Seconds from ``ended`` (the end of a fault) until a block stored now reached ``tier``:
    store a new block, drain, and again every ``poll_s`` until one did (the caller bounds it
    with `deadline`)."""
    for number in itertools.count():
        key = key_of(f"{seed}-after", number)
        await store(cache, [key], calls)
        await calls("drain", cache.drain)
        if key in cache.take_durable(tier):
            return time.monotonic() - ended
        await anyio.sleep(poll_s)
    raise AssertionError("unreachable")


# -- places ----------------------------------------------------------------------------------

DISK = Path("/var/tmp")  # a real disk: O_DIRECT works
SHM = Path("/dev/shm")  # tmpfs


def private_dir(parent: Path, tag: str) -> Path:
    path = parent / f"kvtier-faults-{tag}-{os.getpid()}-{os.urandom(4).hex()}"
    path.mkdir(mode=0o700)
    return path


def fs_tier(root: Path, **extra: Any) -> dict[str, Any]:
    return {"type": "fs", "root_dir": str(root), **extra}


# -- child processes -------------------------------------------------------------------------

TESTS = Path(__file__).resolve().parents[1]


def child_env() -> dict[str, str]:
    """The environment of a child that imports `faults` (and the tests' helpers)."""
    env = dict(os.environ)
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = f"{TESTS}{os.pathsep}{path}" if path else str(TESTS)
    return env


class Child:
    """A ``python -m faults._workers`` process whose stdout lines are read with deadlines;
    its stderr goes where this process's goes (the scenario's log)."""

    def __init__(self, role: str, *args: str) -> None:
        command = [sys.executable, "-m", "faults._workers", role, *args]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, env=child_env())
        assert self.process.stdout is not None
        self._fd = self.process.stdout.fileno()
        self._buffer = b""

    @property
    def pid(self) -> int:
        return self.process.pid

    def line(self, deadline_s: float) -> str | None:
        """The next line, or None at the end of its output or after ``deadline_s``."""
        ends = time.monotonic() + deadline_s
        while b"\n" not in self._buffer:
            left = ends - time.monotonic()
            if left <= 0 or not select.select([self._fd], [], [], left)[0]:
                return None
            chunk = os.read(self._fd, 1 << 16)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    def expect(self, prefix: str, deadline_s: float) -> str:
        line = self.line(deadline_s)
        if line is None or not line.startswith(prefix):
            raise RuntimeError(
                f"child {self.pid}: expected {prefix!r} within {deadline_s} s, got {line!r}"
            )
        return line

    def kill(self) -> None:
        """SIGKILL, and reap it."""
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def wait(self, deadline_s: float) -> int:
        """Its exit status; killed (and failed) after ``deadline_s``."""
        try:
            return self.process.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
