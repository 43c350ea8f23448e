"""One report format for every benchmark: a text table, or one JSON object per line.

A record compares our figure with a reference measured in the same run. ``ratio`` is oriented
so that above 1 is better: ours/reference for throughputs, reference/ours for times and
latencies. Build records with `throughput_record` or `latency_record` so the orientation and
``meets`` are computed in one place.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

__all__ = [
    "JSON_KEYS",
    "BenchRecord",
    "as_quick",
    "budget_record",
    "latency_record",
    "misses",
    "render_table",
    "throughput_record",
]

JSON_KEYS = (
    "bench",
    "case",
    "metric",
    "ours",
    "reference",
    "reference_name",
    "ratio",
    "target",
    "meets",
)
_COLUMNS = ("bench", "case", "metric", "ours", "reference", "ratio", "target", "meets")
_NUMERIC = frozenset({"ours", "reference", "ratio", "target"})
_NONE = "-"


@dataclass(frozen=True)
class BenchRecord:
    """One measured figure of one benchmark case, with its reference where it has one."""

    bench: str
    case: str
    metric: str
    ours: float
    reference: float | None = None
    reference_name: str | None = None
    ratio: float | None = None
    target: float | None = None
    meets: bool | None = None
    unit: str = ""
    # Raw measurements behind ``ours`` and ``reference`` (e.g. per-step times), for plots;
    # not in JSON lines.
    samples: tuple[float, ...] = field(default=(), repr=False, compare=False)
    reference_samples: tuple[float, ...] = field(default=(), repr=False, compare=False)

    def to_json_line(self) -> str:
        """The record as one JSON object with exactly `JSON_KEYS` (null where absent)."""
        return json.dumps({key: getattr(self, key) for key in JSON_KEYS})


def throughput_record(
    bench: str,
    case: str,
    metric: str,
    ours: float,
    *,
    reference: float | None = None,
    reference_name: str | None = None,
    target: float | None = None,
    unit: str = "",
) -> BenchRecord:
    """A record where more is better: ``ratio = ours / reference``."""
    ratio = None if reference is None else _divide(ours, reference)
    return _record(bench, case, metric, ours, reference, reference_name, ratio, target, unit)


def latency_record(
    bench: str,
    case: str,
    metric: str,
    ours: float,
    *,
    reference: float | None = None,
    reference_name: str | None = None,
    target: float | None = None,
    unit: str = "",
) -> BenchRecord:
    """A record where less is better: ``ratio = reference / ours``, so above 1 is better."""
    ratio = None if reference is None else _divide(reference, ours)
    return _record(bench, case, metric, ours, reference, reference_name, ratio, target, unit)


def budget_record(
    bench: str,
    case: str,
    metric: str,
    ours: float,
    *,
    budget: float,
    budget_name: str,
    unit: str = "",
) -> BenchRecord:
    """A record held against a fixed *budget* (not a measurement) where less is better.

    ``ratio = budget / ours`` and the target is 1x (within the budget). A figure of 0 is a
    real outcome here (nothing added), unlike a time of 0: it is within any budget, so
    ``meets`` is true and the ratio, which would be infinite, is left out (None)."""
    if ours < 0 or budget <= 0:
        raise ValueError(
            f"a budget record needs ours >= 0 and budget > 0, not {ours!r}, {budget!r}"
        )
    if ours == 0:
        return BenchRecord(bench, case, metric, ours, budget, budget_name, None, 1.0, True, unit)
    return _record(bench, case, metric, ours, budget, budget_name, budget / ours, 1.0, unit)


def _divide(numerator: float, denominator: float) -> float:
    """``numerator / denominator``; a non-positive denominator is a broken measurement."""
    if denominator <= 0:
        raise ValueError(f"cannot form a ratio with denominator {denominator!r}")
    return numerator / denominator


def _record(
    bench: str,
    case: str,
    metric: str,
    ours: float,
    reference: float | None,
    reference_name: str | None,
    ratio: float | None,
    target: float | None,
    unit: str,
) -> BenchRecord:
    """Build a record, setting ``meets`` when both a ratio and a target exist."""
    meets = None if ratio is None or target is None else ratio >= target
    return BenchRecord(
        bench, case, metric, ours, reference, reference_name, ratio, target, meets, unit
    )


QUICK_NOTE = "quick run: short samples, so no verdicts (meets = -); run without --quick to judge"


def as_quick(records: Iterable[BenchRecord]) -> list[BenchRecord]:
    """The records of a quick run: figures kept, verdicts dropped (``meets`` None).

    A quick run's samples are too small to support a verdict either way: a ratio that would
    meet its target in a full run can read 0.5x on a short sample, and the reverse."""
    return [replace(record, meets=None) for record in records]


def misses(records: Iterable[BenchRecord]) -> list[BenchRecord]:
    """The records that missed their target (``meets`` False)."""
    return [record for record in records if record.meets is False]


def render_table(records: Iterable[BenchRecord], *, quick: bool = False) -> str:
    """An aligned text table of *records*, then the name of each bench's reference; a quick
    run's table says so on its first line."""
    records = list(records)
    rows = [_COLUMNS, *(_cells(record) for record in records)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = [_join(row, widths) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    if quick:
        lines.insert(0, QUICK_NOTE)
    return "\n".join(lines + _reference_notes(records))


def _cells(record: BenchRecord) -> tuple[str, ...]:
    """The table cells of one record, in `_COLUMNS` order."""
    meets = _NONE if record.meets is None else ("yes" if record.meets else "NO")
    return (
        record.bench,
        record.case,
        record.metric,
        _number(record.ours, record.unit),
        _number(record.reference, record.unit),
        _times(record.ratio),
        _times(record.target),
        meets,
    )


def _number(value: float | None, unit: str) -> str:
    """Whole numbers with grouped thousands from 1000 up, else 4 significant digits; ``-``."""
    if value is None:
        return _NONE
    text = f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return f"{text} {unit}" if unit else text


def _times(value: float | None) -> str:
    """A ratio or target as ``2.02x``; ``-`` for none."""
    return _NONE if value is None else f"{value:.2f}x"


def _join(row: Sequence[str], widths: Sequence[int]) -> str:
    """Pad each cell to its column's width: numbers to the right, text to the left."""
    cells = (
        cell.rjust(width) if column in _NUMERIC else cell.ljust(width)
        for column, cell, width in zip(_COLUMNS, row, widths, strict=True)
    )
    return "  ".join(cells).rstrip()


def _reference_notes(records: Sequence[BenchRecord]) -> list[str]:
    """One ``reference for BENCH: NAME`` line per distinct (bench, reference name)."""
    pairs = dict.fromkeys((r.bench, r.reference_name) for r in records if r.reference_name)
    return [f"reference for {bench}: {name}" for bench, name in pairs]
