"""The three operations, end to end, for a directory or an ``s3://`` URL alike: `inspect`
(walk or list, then verify and repair if asked), `gc` (plan, then delete unless a dry run),
and `regions`. Each returns plain results for `kvtier_async.ops.render`; a bad location or
argument raises `layout.OpsError`, and a bucket that cannot be used the obj tier's
`kvtier_async.tiers.s3.TierOpenError`.

An ``s3://`` location runs on asyncio (``anyio.run``), as the obj tier does; a directory runs
in the calling thread, its verify reads in ``jobs`` threads of its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio

from kvtier_async._extras import S3 as S3_MODULES
from kvtier_async._extras import MissingExtraError, require
from kvtier_async.ops import fsroot, regions
from kvtier_async.ops.layout import OpsError, Root
from kvtier_async.ops.regions import RegionInfo
from kvtier_async.ops.results import GcPlan, GcResult, Verification

if TYPE_CHECKING:
    from kvtier_async.ops.s3root import Bucket

__all__ = ["S3Options", "gc", "inspect", "list_regions", "remote"]

# Told the number of blocks and bytes to read, returns the callback that hears of each one.
ProgressFactory = Callable[[int, int], Callable[[int, int], None]]


@dataclass(frozen=True)
class S3Options:
    """How to reach a bucket: ``endpoint`` (``host:port`` or a URL; empty: AWS S3),
    ``region``, the per-request ``timeout_s``, and requests in flight (``jobs``)."""

    endpoint: str = ""
    region: str = ""
    timeout_s: float = 5.0
    jobs: int = 16


def remote(location: str) -> bool:
    """Whether ``location`` names a bucket (``s3:`` or any ``scheme://``: a URL, checked
    by `s3root.parse_url`) rather than a directory."""
    return location.startswith("s3:") or "://" in location


def inspect(
    location: str,
    *,
    verify: bool,
    repair: bool,
    jobs: int,
    s3: S3Options,
    progress: ProgressFactory,
) -> tuple[Root, Verification | None]:
    """Walk (or list) ``location``; with ``verify`` read every block, with ``repair``
    delete the damaged ones."""
    if remote(location):
        run = functools.partial(_inspect_s3, location, verify, repair, s3, progress)
        result: tuple[Root, Verification | None] = anyio.run(run, backend="asyncio")
        return result
    root = fsroot.walk(location)
    if not verify:
        return root, None
    checked = fsroot.verify(location, root, jobs=jobs, progress=_start(progress, root))
    if repair and checked.damaged and not _refuse_repair(checked):
        checked.removed, checked.kept = fsroot.repair(location, checked.damaged)
    return root, checked


def _refuse_repair(checked: Verification) -> bool:
    """Whether ``--repair`` must delete nothing: blocks sound by their own headers
    contradict ``config.json``, so its verdicts on the rest cannot be trusted either."""
    checked.repair_refused = bool(checked.disagree)
    return checked.repair_refused


async def _inspect_s3(
    location: str, verify: bool, repair: bool, s3: S3Options, progress: ProgressFactory
) -> tuple[Root, Verification | None]:
    async with _bucket(location, s3) as bucket:
        root = await bucket.walk()
        if not verify:
            return root, None
        checked = await bucket.verify(root, progress=_start(progress, root))
        if repair and checked.damaged and not _refuse_repair(checked):
            checked.removed, checked.kept = await bucket.repair(checked.damaged)
        return root, checked


def _start(progress: ProgressFactory, root: Root) -> Callable[[int, int], None]:
    blocks = [block for ns in root.namespaces.values() for block in ns.blocks]
    return progress(len(blocks), sum(block.size for block in blocks))


def gc(
    location: str, max_bytes: int, *, model: str | None, dry_run: bool, s3: S3Options
) -> tuple[GcPlan, GcResult | None]:
    """Plan the deletions that bring ``location`` (``model``'s namespace, or all) to at
    most ``max_bytes``; carry them out unless ``dry_run``."""
    if remote(location):
        run = functools.partial(_gc_s3, location, max_bytes, model, dry_run, s3)
        result: tuple[GcPlan, GcResult | None] = anyio.run(run, backend="asyncio")
        return result
    plan = fsroot.gc_plan(location, max_bytes, model)
    return plan, None if dry_run else fsroot.gc_apply(plan)


async def _gc_s3(
    location: str, max_bytes: int, model: str | None, dry_run: bool, s3: S3Options
) -> tuple[GcPlan, GcResult | None]:
    async with _bucket(location, s3) as bucket:
        plan = await bucket.gc_plan(max_bytes, model)
        return plan, None if dry_run else await bucket.gc_apply(plan)


def _bucket(location: str, s3: S3Options) -> AbstractAsyncContextManager[Bucket]:
    """The async context of the bucket at ``location``: a `Bucket` (an `OpsError`, a usage
    error, when the s3 extra is not installed)."""
    try:
        require("s3", S3_MODULES, f"{location}: a bucket")
    except MissingExtraError as exc:
        raise OpsError(str(exc)) from None
    from kvtier_async.ops.s3root import connect, parse_url

    return connect(
        parse_url(location),
        endpoint=s3.endpoint,
        region=s3.region,
        timeout_s=s3.timeout_s,
        concurrency=s3.jobs,
    )


def list_regions(
    directory: str, *, remove_stale: bool
) -> tuple[list[RegionInfo], list[str], list[str]]:
    """``(regions, removed, kept)``: with ``remove_stale``, the stale regions nobody maps
    are removed first (kept: stale ones still mapped), then the rest listed."""
    removed: list[str] = []
    kept: list[str] = []
    if remove_stale:
        removed, kept = regions.remove_stale(directory)
    return regions.list_regions(directory), removed, kept
