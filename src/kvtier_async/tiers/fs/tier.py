"""The fs tier's async face: `FsTier`, its configuration (`from_config`, `parse_mode`) and its
statistics.

*Layout.* Block ``key`` lives at ``<root_dir>/`` + `block_relpath`, in the block file format
(`kvtier_async.tiers.blockfile`), and ``<root_dir>/<model>_<digest>/config.json`` records
``ctx.namespace_fields()``; another digest is another namespace.

*Open.* `FsTier.open` creates the directories (mode 0700, or per ``mode``), writes
``config.json``, narrows an existing namespace directory of this user to the directory mode
(so blocks written by older versions become private too), probes how to publish and whether
O_DIRECT works (`kvtier_async.tiers.fs.publish`; ``detail`` in `FsTier.statistics` tells),
deletes named temporaries of dead processes (`kvtier_async.tiers.fs.tempfiles`) and, with
``max_bytes``, rebuilds its access record (`kvtier_async.tiers.fs.records`).

*Threads.* Every system call runs off the event loop, under two `anyio.CapacityLimiter`\\ s
sized ``read_workers`` and ``write_workers``; lookups are one worker-thread call per batch.
The blocking half (`kvtier_async.tiers.fs.files.BlockFiles`) is plain synchronous code, safe
to call from many threads. When the C helper (`kvtier_async.tiers.fs.native`) could be built
and files are published by rename, a load or store batch is one worker-thread call that hands
the file work to the helper's pool of ``read_workers`` or ``write_workers`` C threads (started
at the first batch, joined by `FsTier.aclose`), which move its blocks in parallel with no GIL
held. Otherwise the Python path runs the same steps, the batch split into chunks of at least
`MIN_CHUNK_BYTES`, at most one per worker (``path=`` in ``detail`` says which).

*Statistics* count blocks and bytes, the block files the tier deleted on its own (their keys
wait for `FsTier.take_removed`), stores that failed for lack of space and the error of the
last failed store, and the warning lines rate-limiting kept out of the log.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Final, Literal

import anyio
import anyio.to_thread
from pydantic import BeforeValidator, Field, field_validator

from kvtier_async._log import get_logger
from kvtier_async.config import ConfigError, NonEmptyStr
from kvtier_async.tiers.base import SecondaryTier, TierConfig, TierContext, TierStatistics
from kvtier_async.tiers.blockfile import HEADER_BYTES
from kvtier_async.tiers.fs.files import (
    STORE_FAILED,
    STORE_PRESENT,
    STORE_WRITTEN,
    BlockFiles,
    Reports,
)
from kvtier_async.tiers.fs.publish import PRIVATE_MODE, Perms
from kvtier_async.tiers.fs.records import REMOVED_DAMAGED, REMOVED_EVICTED, Usage

__all__ = [
    "DEFAULT_READ_WORKERS",
    "DEFAULT_WRITE_WORKERS",
    "MIN_CHUNK_BYTES",
    "FsTier",
    "FsTierConfig",
    "FsTierStatistics",
    "from_config",
    "parse_mode",
]

log = get_logger(__name__)

# Measured on a virtio ext4 disk (2 vCPUs), 256 KiB blocks, C path: loads best at 16; stores
# with 32 writers at or above 16 in two of three interleaved A/B runs (medians 1.33 vs 1.25
# GB/s, 0.83 vs 0.70, 0.59 vs 0.68; 64 no better): a file creation waits on metadata, so more
# in flight keep the disk busier. The run-to-run noise of that disk is larger than the gap.
DEFAULT_READ_WORKERS: Final = 16
DEFAULT_WRITE_WORKERS: Final = 32
# Python path: bytes per worker-thread call at least, when a batch is split across workers
# (the C path makes one call per batch and spreads the blocks over its own threads). A hop
# costs 50-300 us of CPU on the 2-core development box (more under trio); 4 MiB takes ~3 ms
# of disk time. Measured (256 KiB blocks, jobs of 16): one block per call used 2x the CPU of
# 16 per call, and loads ran up to 1.5x slower.
MIN_CHUNK_BYTES: Final = 4 << 20
# ``mode`` presets: "private" (the default), "group" (group members read and write too).
_MODE_PRESETS: Final = {"private": PRIVATE_MODE, "group": 0o660}


# -- configuration ---------------------------------------------------------------------------


def _mode(value: object) -> int:
    return parse_mode(value)


class FsTierConfig(TierConfig):
    """``{"type": "fs", "root_dir": ..., ...}`` (see the README for each field)."""

    type: Literal["fs"] = "fs"
    root_dir: NonEmptyStr
    n_read_workers: int = Field(DEFAULT_READ_WORKERS, ge=1, le=1024)
    n_write_workers: int = Field(DEFAULT_WRITE_WORKERS, ge=1, le=1024)
    max_bytes: int | None = Field(None, ge=1)  # at least one block and its header: checked at build
    fsync: bool = False
    mode: Annotated[int, BeforeValidator(_mode)] = Field(PRIVATE_MODE, validate_default=False)

    @field_validator("root_dir")
    @classmethod
    def _no_nul(cls, value: str) -> str:
        if "\x00" in value:
            raise ValueError("must not contain NUL characters")
        return value


def from_config(config: FsTierConfig, name: str, ctx: TierContext) -> FsTier:
    """Build an `FsTier` from its validated config."""
    least = HEADER_BYTES + ctx.block_bytes
    if config.max_bytes is not None and config.max_bytes < least:
        got = config.max_bytes
        raise ConfigError(config.field("max_bytes"), f"must be >= {least} (one block), got {got}")
    return FsTier(
        name,
        ctx,
        read_workers=config.n_read_workers,
        write_workers=config.n_write_workers,
        root_dir=config.root_dir,
        max_bytes=config.max_bytes,
        fsync=config.fsync,
        mode=config.mode,
    )


def parse_mode(value: object) -> int:
    """The file mode of ``value``: an int, an octal string (``"0640"``, ``"640"``,
    ``"0o640"``) or a preset (``"private"``: 0600, ``"group"``: 0660). Read and write bits
    only, the owner's both included. ValueError says what is allowed."""
    mode: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        mode = value
    elif isinstance(value, str):
        text = value.strip().lower()
        if text in _MODE_PRESETS:
            mode = _MODE_PRESETS[text]
        elif re.fullmatch(r"(0o)?[0-7]{1,4}", text):
            mode = int(text.removeprefix("0o"), 8)
    if mode is None or mode & ~0o666 or mode & 0o600 != 0o600:
        raise ValueError(
            "must be a file mode with read/write bits only and the owner's read and write "
            f"(an octal string like '0600', '0640', '0660'), or one of "
            f"{sorted(_MODE_PRESETS)}; got {value!r}"
        )
    return mode


# -- the async tier --------------------------------------------------------------------------


@dataclass(frozen=True)
class FsTierStatistics(TierStatistics):
    """`TierStatistics` plus the block files the fs tier deleted on its own."""

    removed_damaged: int = 0  # failed verification, wrong size, a link (deleted)
    removed_evicted: int = 0  # least recently used, for max_bytes
    removed_unreported: int = 0  # keys dropped from the `take_removed` queue (overflow)
    no_space_failures: int = 0  # stores that failed with ENOSPC or EDQUOT (no room left)
    last_store_error: str = ""  # errno name of the last failed store; "" once stores succeed
    warnings_suppressed: int = 0  # rate-limited warning lines not logged


class FsTier(SecondaryTier):
    """Blocks as files under ``root_dir`` (see `kvtier_async.tiers.fs` and its modules)."""

    kind = "fs"

    def __init__(
        self,
        name: str,
        ctx: TierContext,
        read_workers: int = DEFAULT_READ_WORKERS,
        write_workers: int = DEFAULT_WRITE_WORKERS,
        *,
        root_dir: str | os.PathLike[str],
        max_bytes: int | None = None,
        fsync: bool = False,
        mode: int | str = PRIVATE_MODE,
    ) -> None:
        super().__init__(name, ctx, read_workers, write_workers)
        self.root_dir = os.fspath(root_dir)  # made absolute at open (getcwd may block)
        self.max_bytes = max_bytes
        self.fsync = fsync
        try:
            self.mode = parse_mode(mode)
        except ValueError as exc:
            raise ValueError(f"mode {exc}") from None
        self._reports = Reports()
        self._read_limiter = anyio.CapacityLimiter(read_workers)
        self._write_limiter = anyio.CapacityLimiter(write_workers)
        self._lookup_limiter = anyio.CapacityLimiter(1)
        self._files: BlockFiles | None = None
        self._usage: Usage | None = None
        self._chunk_blocks = max(1, MIN_CHUNK_BYTES // max(1, ctx.block_bytes))

    @property
    def namespace_dir(self) -> str:
        """``<root_dir>/<model>_<digest>``: this configuration's directory."""
        return os.path.join(self.root_dir, self.ctx.namespace)

    async def open(self) -> None:
        if self._files is not None:
            raise RuntimeError(f"{self!r} is already open")
        self._files = await anyio.to_thread.run_sync(self._open_files)
        self._usage = self._files.usage  # its last figures stay readable after the close
        log.info("fs tier open", tier=self.name, detail=self._files.describe())

    async def aclose(self) -> None:
        files, self._files = self._files, None
        if files is not None:
            await anyio.to_thread.run_sync(files.close)

    async def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        files = self._ready()
        if not keys:
            return []
        return await anyio.to_thread.run_sync(
            files.exists_many, list(keys), limiter=self._lookup_limiter
        )

    async def store(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        outcomes = await self._in_chunks(
            self._ready().store_many, keys, blocks, self._write_limiter
        )
        counters = self.counters
        counters.written += outcomes.count(STORE_WRITTEN)
        counters.present += outcomes.count(STORE_PRESENT)
        return [outcome != STORE_FAILED for outcome in outcomes]

    async def load(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        outcomes = await self._in_chunks(self._ready().load_many, keys, blocks, self._read_limiter)
        return [bool(outcome) for outcome in outcomes]

    def take_removed(self) -> list[bytes]:
        return self._reports.removed.take()

    def statistics(self) -> FsTierStatistics:
        files, reports = self._files, self._reports
        removed, store_errors = reports.removed, reports.store_errors
        detail = "closed" if files is None else files.describe()
        usage = self._usage
        return FsTierStatistics(
            name=self.name,
            kind=self.kind,
            detail=detail,
            used_bytes=None if usage is None else usage.used,
            max_bytes=None if usage is None else usage.max_bytes,
            removed_damaged=removed.counts[REMOVED_DAMAGED],
            removed_evicted=removed.counts[REMOVED_EVICTED],
            removed_unreported=removed.dropped,
            no_space_failures=store_errors.no_space,
            last_store_error=store_errors.last,
            warnings_suppressed=reports.warn.suppressed,
        )

    # -- internals -----------------------------------------------------------------------

    def _ready(self) -> BlockFiles:
        if self._files is None:
            raise RuntimeError(f"{self!r} is not open")
        return self._files

    def _open_files(self) -> BlockFiles:
        try:
            root = os.path.abspath(self.root_dir)
            return BlockFiles.open(
                self.name,
                root,
                _path_context(self.ctx),
                self.max_bytes,
                self.fsync,
                (self.read_workers, self.write_workers),
                Perms.of(self.mode),
                self._reports,
            )
        except OSError as exc:
            raise OSError(
                exc.errno, f"fs tier {self.name!r}: root_dir {self.root_dir!r} is unusable: {exc}"
            ) from exc

    async def _in_chunks(
        self,
        fn: Callable[[Sequence[bytes], Sequence[memoryview]], list[int]],
        keys: Sequence[bytes],
        blocks: Sequence[memoryview],
        limiter: anyio.CapacityLimiter,
    ) -> list[int]:
        """Run ``fn`` over ``keys``/``blocks`` in worker threads: the whole batch in one call
        on the C path (its pool spreads the blocks), else a chunk per thread call."""
        if len(keys) != len(blocks):
            raise ValueError(f"{len(keys)} keys but {len(blocks)} blocks")
        if not keys:
            return []
        if self._ready().fsio is not None:  # the C pool spreads the blocks over its threads
            spans = [(0, len(keys))]
        else:
            spans = _spans(len(keys), self._chunk_blocks, int(limiter.total_tokens))
        if len(spans) <= 1:
            return await anyio.to_thread.run_sync(fn, keys, blocks, limiter=limiter)
        results: list[list[int]] = [[] for _ in spans]

        async def run(index: int, start: int, stop: int) -> None:
            results[index] = await anyio.to_thread.run_sync(
                fn, keys[start:stop], blocks[start:stop], limiter=limiter
            )

        async with anyio.create_task_group() as tg:
            for index, (start, stop) in enumerate(spans):
                tg.start_soon(run, index, start, stop)
        return [outcome for chunk in results for outcome in chunk]


def _spans(count: int, min_size: int, workers: int) -> list[tuple[int, int]]:
    """Split ``range(count)`` into at most ``workers`` spans of at least ``min_size``."""
    size = max(min_size, -(-count // max(1, workers)))
    return [(start, min(start + size, count)) for start in range(0, count, size)]


class _PathContext(TierContext):
    """A `TierContext` that computes `namespace` (JSON + SHA-256, ~40 us) once, so that
    `block_relpath` costs about a microsecond per key."""

    @functools.cached_property
    def namespace(self) -> str:
        return str(TierContext.namespace.__get__(self))


def _path_context(ctx: TierContext) -> TierContext:
    return _PathContext(**{f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx)})
