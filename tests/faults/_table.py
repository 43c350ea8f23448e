"""The table: one markdown table for stdout and the README, then what failed."""

from __future__ import annotations

import math
from collections.abc import Sequence

from faults._common import Row

HEADER = (
    "| fault | trials | wrong bytes served | durable blocks lost "
    "| longest call blocked, s (bound) | recovery after the fault ends, s (bound) |"
)


def render(rows: Sequence[Row], *, seed: int, seconds: float) -> str:
    lines = [HEADER, "|---|--:|--:|--:|--:|--:|"]
    lines += [_line(row) for row in rows]
    lines.append("")
    lines.append(
        f"{len(rows)} faults, {sum(r.trials for r in rows)} trials, seed {seed}, "
        f"{seconds:.0f} s. A recovery is the time from the end of the fault until a store "
        "reached the tier again (-: the fault has no end to recover from). Bounds:"
    )
    lines.append("")
    lines += [f"- {text}" for text in dict.fromkeys(t for row in rows for t in row.bounds)]
    notes = [f"{row.fault}: {note}" for row in rows for note in row.notes]
    if notes:
        lines.append("")
        lines += [f"- note: {note}" for note in notes]
    return "\n".join(lines)


def _line(row: Row) -> str:
    if row.skipped:
        return f"| {row.fault} | **SKIPPED: {row.skipped}** | - | - | - | - |"
    mark = " **FAILED**" if row.failures() else ""
    return (
        f"| {row.fault}{mark} | {row.trials} | {row.wrong_bytes} | {row.durable_lost} "
        f"| {_seconds(row.longest_s, row.bound_s)} "
        f"| {_seconds(row.recovery_s, row.recovery_bound_s)} |"
    )


def _seconds(value: float | None, bound: float | None) -> str:
    if value is None:
        return "-"
    if bound is None or math.isinf(bound):
        return f"{value:.2f}"
    return f"{value:.2f} ({bound:g})"


def failures(rows: Sequence[Row]) -> list[str]:
    return [problem for row in rows for problem in row.failures()]
