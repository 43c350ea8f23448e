"""Benchmarks, apart from tests: each measures ours against a reference in the same run.

`BENCHMARKS` maps a name to ``"module:function"``, imported only when that benchmark runs, so
listing them costs nothing. Every function has the `BenchFn` signature and returns a list of
`BenchRecord` (see `kvtier_async.bench.report`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Protocol

from kvtier_async import _extras
from kvtier_async.bench.report import BenchRecord

__all__ = ["BENCHMARKS", "BenchFn", "load"]

BENCHMARKS: dict[str, str] = {
    "ledger": "kvtier_async.bench.ledger:run",
    "copy": "kvtier_async.bench.copy:run",
    "gpu": "kvtier_async.bench.gpu:run",
    "engine": "kvtier_async.bench.engine:run",
    "fs": "kvtier_async.bench.fs:run",
    "sched": "kvtier_async.bench.sched:run",
    "s3": "kvtier_async.bench.s3:run",
    "obj": "kvtier_async.bench.obj:run",
    "e2e": "kvtier_async.bench.e2e:run",
    "fleet": "kvtier_async.bench.fleet:run",
}


class BenchFn(Protocol):
    """A benchmark: ``quick`` for a short smoke run, ``progress`` for one-line status notes."""

    def __call__(
        self, *, quick: bool = False, progress: Callable[[str], None] | None = None
    ) -> list[BenchRecord]: ...


# The extras a benchmark needs beyond the base install: `load` names a missing one.
NEEDS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "s3": (("s3", _extras.S3), ("bench", _extras.BENCH_S3)),
    "obj": (("s3", _extras.S3),),
    "e2e": (("s3", _extras.S3), ("bench", _extras.BENCH_S3)),
    "fleet": (("fleet", _extras.FLEET),),
}


def load(name: str) -> BenchFn:
    """Import and return the function of benchmark *name* (`KeyError` if there is none;
    `kvtier_async._extras.MissingExtraError` naming the extra it needs, if missing)."""
    for extra, modules in NEEDS.get(name, ()):
        _extras.require(extra, modules, f"bench {name}")
    module_name, _, function_name = BENCHMARKS[name].partition(":")
    function: BenchFn = getattr(importlib.import_module(module_name), function_name)
    return function
