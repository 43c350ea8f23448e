"""``kvtier bench --plot DIR``: PNG figures of a run's records (matplotlib, the ``plot`` extra).

- ``<bench>.png`` for every benchmark: one horizontal bar per (case, metric) that has a
  reference, its ratio (oriented so that above 1 is better), the target marked on each bar
  and a line at 1.0 (parity with the reference).
- ``fs-by-size.png``: the fs benchmark's GB/s and CPU seconds per GB, ours beside the
  reference, case by case (the block size is in the case name).
- ``<bench>-distribution.png`` for records that carry raw samples (the sched benchmark's
  per-step times): the empirical distribution of ours against the reference's.

matplotlib is imported here only, with the non-interactive Agg backend, so nothing opens a
window and nothing else in the package needs it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .report import BenchRecord

__all__ = ["PlotUnavailableError", "write_plots"]


class PlotUnavailableError(RuntimeError):
    """matplotlib is not installed."""


def write_plots(
    records: Sequence[BenchRecord], directory: str, *, quick: bool = False
) -> list[str]:
    """Write the figures of *records* into *directory* (created, private); their paths."""
    plt = pyplot()
    out = Path(directory)
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    written: list[str] = []
    suffix = " (quick run: no verdicts)" if quick else ""
    for bench in dict.fromkeys(r.bench for r in records):
        mine = [r for r in records if r.bench == bench]
        written += _save(plt, _ratios(plt, bench, mine, suffix), out / f"{bench}.png")
        if bench == "fs":
            written += _save(plt, _fs_by_size(plt, mine, suffix), out / "fs-by-size.png")
        sampled = [r for r in mine if r.samples]
        if sampled:
            figure = _distributions(plt, bench, sampled, suffix)
            written += _save(plt, figure, out / f"{bench}-distribution.png")
    return written


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display), or
    `PlotUnavailableError` naming the extra that brings it."""
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotUnavailableError(
            "--plot needs matplotlib: pip install 'kvtier-async[plot]'"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, figure: Any, path: Path) -> list[str]:
    if figure is None:
        return []
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    os.chmod(path, 0o600)
    return [str(path)]


def _ratios(plt: Any, bench: str, records: Sequence[BenchRecord], suffix: str) -> Any:
    rows = [r for r in records if r.ratio is not None]
    if not rows:
        return None
    labels = [f"{r.case} · {r.metric}" for r in rows]
    height = 0.6 + 0.32 * len(rows)
    figure, axes = plt.subplots(figsize=(8.5, height))
    colours = [_colour(r) for r in rows]
    positions = range(len(rows))
    axes.barh(positions, [r.ratio for r in rows], color=colours)
    for y, record in zip(positions, rows):
        if record.target is not None:
            axes.plot([record.target] * 2, [y - 0.4, y + 0.4], color="black", linewidth=2)
        axes.text(record.ratio, y, f" {record.ratio:.2f}x", va="center", fontsize=8)
    axes.axvline(1.0, color="grey", linestyle="--", linewidth=1)
    axes.set_yticks(list(positions), labels, fontsize=8)
    axes.invert_yaxis()
    axes.set_xlabel("ratio to the reference (above 1 is better); black tick: target")
    names = sorted({r.reference_name for r in rows if r.reference_name})
    axes.set_title(f"kvtier bench {bench}{suffix}\nreference: {'; '.join(names)}", fontsize=9)
    return figure


def _colour(record: BenchRecord) -> str:
    if record.meets is None:
        return "#7a9cc6"
    return "#4c9a5b" if record.meets else "#c0504d"


def _fs_by_size(plt: Any, records: Sequence[BenchRecord], suffix: str) -> Any:
    metrics = [m for m in dict.fromkeys(r.metric for r in records) if m in ("GB/s", "core-s/GB")]
    if not metrics:
        return None
    figure, panels = plt.subplots(len(metrics), 1, figsize=(9, 3.4 * len(metrics)), squeeze=False)
    for axes, metric in zip(panels[:, 0], metrics):
        rows = [r for r in records if r.metric == metric and r.reference is not None]
        positions = list(range(len(rows)))
        axes.bar([p - 0.2 for p in positions], [r.ours for r in rows], 0.4, label="ours")
        axes.bar(
            [p + 0.2 for p in positions],
            [r.reference or 0.0 for r in rows],
            0.4,
            label="reference (named in the case)",
        )
        axes.set_xticks(positions, [r.case for r in rows], rotation=30, ha="right", fontsize=7)
        axes.set_ylabel(metric)
        axes.legend(fontsize=8)
    panels[0, 0].set_title(f"kvtier bench fs: throughput and CPU by block size{suffix}", fontsize=9)
    return figure


def _distributions(plt: Any, bench: str, records: Sequence[BenchRecord], suffix: str) -> Any:
    figure, panels = plt.subplots(len(records), 1, figsize=(8, 2.8 * len(records)), squeeze=False)
    for axes, record in zip(panels[:, 0], records):
        for label, values in (("ours", record.samples), ("reference", record.reference_samples)):
            if values:
                ordered = sorted(values)
                share = [(i + 1) / len(ordered) for i in range(len(ordered))]
                axes.step(ordered, share, where="post", label=f"{label} (n={len(ordered)})")
        axes.set_xscale("log")
        axes.set_xlabel(f"{record.metric} ({record.unit})" if record.unit else record.metric)
        axes.set_ylabel("share of samples")
        axes.set_title(f"{record.case}", fontsize=8)
        axes.legend(fontsize=8)
    panels[0, 0].set_title(
        f"kvtier bench {bench}: distributions{suffix}\n{records[0].case}", fontsize=9
    )
    return figure
