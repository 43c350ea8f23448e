"""How the operations show: text for people, one JSON document for scripts, a progress line,
and byte counts both ways (`parse_size` reads ``512M``, `format_size` writes ``5.8 MiB``).

Times: text shows local time to the second, JSON ISO 8601 in UTC. Paths are relative to the
root (a directory, or a bucket prefix). The progress line goes to a stream the caller gives
(the command's stderr): rewritten in place at most `REDRAW_S` apart on a terminal, else one
line at each tenth of the way, so a log file gets ten lines, not thousands.
"""

from __future__ import annotations

import datetime
import json
import re
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, TextIO

from kvtier_async.ops.layout import Block, Namespace, Root
from kvtier_async.ops.regions import RegionInfo
from kvtier_async.ops.results import GcPlan, GcResult, Verification

__all__ = [
    "REDRAW_S",
    "Progress",
    "format_size",
    "gc_json",
    "gc_text",
    "parse_size",
    "regions_json",
    "regions_text",
    "root_json",
    "root_text",
    "to_json",
    "verification_json",
    "verification_text",
]

REDRAW_S: Final = 0.2
_UNITS: Final = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5}
_SIZE_RE: Final = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGTP]?)(?:I?B)?", re.IGNORECASE)


# -- sizes -----------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """Bytes in ``text``: a number with an optional suffix K, M, G, T or P (powers of 1024;
    ``KiB``, ``KB`` and ``k`` mean the same); ValueError says what is accepted."""
    match = _SIZE_RE.fullmatch(text.strip())
    if match is None:
        raise ValueError(
            f"expected a byte count such as 1073741824, 512M, 10G or 1T (powers of 1024), "
            f"got {text!r}"
        )
    return int(float(match[1]) * 1024 ** _UNITS[match[2].upper()])


def format_size(n: int) -> str:
    """``n`` bytes for people: ``512 B``, ``16.0 KiB``, ``5.8 MiB``."""
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            break
        value /= 1024
    return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"


def _local(ns: int | None) -> str:
    if ns is None:
        return "-"
    return datetime.datetime.fromtimestamp(ns / 1e9).strftime("%Y-%m-%d %H:%M:%S")


def _iso(ns: int | None) -> str | None:
    if ns is None:
        return None
    return datetime.datetime.fromtimestamp(ns / 1e9, datetime.UTC).isoformat()


def to_json(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, sort_keys=False)


# -- inspect ---------------------------------------------------------------------------------


def root_text(root: Root) -> str:
    """The inspect report: a summary line, then each namespace (config, ranks, the rest)."""
    namespaces = root.sorted_namespaces()
    blocks = sum(len(ns.blocks) for ns in namespaces)
    size = sum(b.size for ns in namespaces for b in ns.blocks)
    lines = [
        f"{root.location}: {len(namespaces)} model namespace"
        f"{'' if len(namespaces) == 1 else 's'}, {blocks} blocks, {format_size(size)}"
    ]
    if not namespaces:
        lines.append("  no <model>_<digest> directories here: is this a tier's root?")
    for ns in namespaces:
        lines += ["", *_namespace_text(ns)]
    if root.others:
        lines += ["", f"outside any namespace: {len(root.others)} entries"]
        lines += [f"  {path}" for path in root.others[:10]]
        lines += [f"  ... {len(root.others) - 10} more"] if len(root.others) > 10 else []
    return "\n".join(lines)


def _namespace_text(ns: Namespace) -> list[str]:
    lines = [ns.name, f"  model {ns.model}  digest {ns.digest}"]
    if ns.config is not None:
        fields = " ".join(f"{k}={v}" for k, v in sorted(ns.config.items()) if k != "model")
        lines.append(f"  config: {fields}")
    else:
        lines.append(f"  config: {ns.config_note}")
    ranks = ns.ranks()
    if ranks:
        lines.append(f"  {'rank':<6}{'blocks':>8}{'bytes':>12}  {'oldest':<21}newest")
    for rank in ranks:
        lines.append(
            f"  {'r' + str(rank.rank):<6}{rank.blocks:>8}{format_size(rank.bytes):>12}"
            f"  {_local(rank.oldest_ns):<21}{_local(rank.newest_ns)}"
        )
    if not ranks:
        lines.append("  no blocks")
    temps = _temp_counts(ns)
    shown = ", ".join(f"{count} {state}" for state, count in temps.items() if count)
    lines.append(f"  temporary files: {sum(temps.values())}" + (f" ({shown})" if shown else ""))
    others = ns.others + ns.links
    lines.append(f"  other files: {len(others)}")
    lines += [f"    {path}" for path in others[:10]]
    lines += [f"    ... {len(others) - 10} more"] if len(others) > 10 else []
    return lines


def _temp_counts(ns: Namespace) -> dict[str, int]:
    counts = {"live": 0, "dead": 0, "foreign": 0, "unknown": 0}
    for temp in ns.temps:
        counts[temp.writer] = counts.get(temp.writer, 0) + 1
    return counts


def root_json(root: Root) -> dict[str, Any]:
    namespaces = root.sorted_namespaces()
    return {
        "location": root.location,
        "kind": root.kind,
        "blocks": sum(len(ns.blocks) for ns in namespaces),
        "bytes": sum(b.size for ns in namespaces for b in ns.blocks),
        "namespaces": [_namespace_json(ns) for ns in namespaces],
        "other_files": root.others,
    }


def _namespace_json(ns: Namespace) -> dict[str, Any]:
    return {
        "namespace": ns.name,
        "model": ns.model,
        "digest": ns.digest,
        "config": ns.config,
        "config_note": ns.config_note,
        "blocks": len(ns.blocks),
        "bytes": sum(b.size for b in ns.blocks),
        "ranks": [
            {
                "rank": r.rank,
                "blocks": r.blocks,
                "bytes": r.bytes,
                "oldest": _iso(r.oldest_ns),
                "newest": _iso(r.newest_ns),
            }
            for r in ns.ranks()
        ],
        "temp_files": _temp_counts(ns),
        "other_files": ns.others,
        "links": ns.links,
    }


# -- verify ----------------------------------------------------------------------------------


def verification_text(result: Verification, *, repair: bool) -> str:
    rate = result.bytes_read / result.seconds if result.seconds > 0 else 0.0
    lines = [
        f"verify: {result.checked} of {result.total} blocks checked, {result.good} good, "
        f"{len(result.damaged)} damaged, {result.vanished} vanished, "
        f"{len(result.errors)} unreadable"
        + (f", {len(result.disagree)} disagree with config.json" if result.disagree else "")
        + f"; {format_size(result.bytes_read)} in "
        f"{result.seconds:.1f} s ({rate / 1e6:.1f} MB/s)"
    ]
    for damage in result.damaged:
        lines.append(f"damaged: {damage.relpath}: {damage.reason}")
    for error in result.errors:
        lines.append(f"unreadable: {error}")
    for odd in result.disagree:
        lines.append(
            f"disagrees with config.json: {odd.relpath}: sound by its own header, a payload "
            f"of {odd.payload} bytes where config.json says block_bytes={odd.configured}"
        )
    if result.repair_refused:
        lines.append(
            f"repair refused, nothing deleted: {len(result.disagree)} sound blocks contradict "
            "config.json, so it cannot judge the rest; check config.json (or move the blocks "
            "that do not belong), then run --repair again"
        )
    elif repair:
        lines.append(
            f"repair: {len(result.removed)} damaged blocks deleted"
            + (f", {len(result.kept)} could not be" if result.kept else "")
        )
        lines += [f"not deleted: {d.relpath}" for d in result.kept]
    elif result.damaged:
        lines.append("run again with --repair to delete the damaged blocks")
    return "\n".join(lines)


def verification_json(result: Verification, *, repair: bool) -> dict[str, Any]:
    removed = {d.relpath for d in result.removed}
    return {
        "total": result.total,
        "checked": result.checked,
        "good": result.good,
        "vanished": result.vanished,
        "bytes_read": result.bytes_read,
        "seconds": round(result.seconds, 3),
        "damaged": [
            {"path": d.relpath, "reason": d.reason, "deleted": d.relpath in removed}
            for d in result.damaged
        ],
        "unreadable": result.errors,
        "disagree_with_config": [
            {"path": d.relpath, "payload_bytes": d.payload, "config_block_bytes": d.configured}
            for d in result.disagree
        ],
        "repair": repair,
        "repair_refused": result.repair_refused,
    }


class Progress:
    """A progress line for ``total`` items of ``total_bytes`` on ``stream``: items/s, MB/s,
    ETA (see the module docstring); call it with each item's ``(count, bytes)``, then
    `finish`."""

    def __init__(
        self,
        label: str,
        total: int,
        total_bytes: int,
        stream: TextIO,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label = label
        self.total = total
        self.total_bytes = total_bytes
        self.stream = stream
        self.clock = clock
        self.tty = stream.isatty()
        self.done = self.bytes = 0
        self.started = self._drawn = clock()
        self._tenth = 0

    def __call__(self, count: int, nbytes: int) -> None:
        self.done += count
        self.bytes += nbytes
        now = self.clock()
        if self.tty:
            if now - self._drawn >= REDRAW_S:
                self._drawn = now
                self.stream.write(f"\r{self.line(now)}\x1b[K")
                self.stream.flush()
        elif self.total and (tenth := self.done * 10 // self.total) > self._tenth:
            self._tenth = tenth
            self.stream.write(self.line(now) + "\n")
            self.stream.flush()

    def finish(self) -> None:
        if self.tty:
            self.stream.write(f"\r{self.line(self.clock())}\x1b[K\n")
            self.stream.flush()

    def line(self, now: float) -> str:
        seconds = max(now - self.started, 1e-9)
        rate, byte_rate = self.done / seconds, self.bytes / seconds
        left = self.total - self.done
        eta = _duration(left / rate) if rate > 0 and left > 0 else ("-" if left else "0:00")
        share = self.done / self.total if self.total else 1.0
        return (
            f"{self.label}: {self.done}/{self.total} blocks ({share:.0%}), {rate:.0f} "
            f"blocks/s, {byte_rate / 1e6:.1f} MB/s, ETA {eta}"
        )


def _duration(seconds: float) -> str:
    whole = int(seconds + 0.5)
    hours, rest = divmod(whole, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


# -- gc --------------------------------------------------------------------------------------


def gc_text(plan: GcPlan, result: GcResult | None, *, listed: bool = False) -> str:
    """A dry run's summary (``result`` None), or what was deleted; ``listed``: each block
    and temporary file too (``kvtier gc -v``; thousands of lines on a real root)."""
    scope = "all models" if plan.namespaces is None else ", ".join(plan.namespaces)
    lines = [
        f"{plan.location} ({scope}): {plan.blocks} blocks, {format_size(plan.bytes)}; "
        f"limit {format_size(plan.max_bytes)}"
    ]
    if result is None:
        verb = "would delete"
        blocks: Sequence[Block] = plan.victims
    else:
        verb = "deleted"
        blocks = result.deleted
    freed = sum(b.size for b in blocks)
    if not plan.victims:
        lines.append("nothing to delete: under the limit")
    else:
        order = "least recently used first"
        if listed:
            lines.append(f"{verb} {len(blocks)} blocks ({format_size(freed)}), {order}:")
            lines += [f"  {_local(b.mtime_ns)}  {format_size(b.size):>10}  {b.relpath}"
                      for b in blocks]  # fmt: skip
        else:
            span = (
                f", {_local(blocks[0].mtime_ns)} to {_local(blocks[-1].mtime_ns)}" if blocks else ""
            )
            lines.append(
                f"{verb} {len(blocks)} blocks ({format_size(freed)}), {order}{span} (-v lists them)"
            )
    left_blocks, left = plan.blocks - len(blocks), plan.bytes - freed
    lines.append(
        f"{'would leave' if result is None else 'left'} {left_blocks} blocks, {format_size(left)}"
    )
    temps = plan.temps if result is None else result.temps_removed
    if temps:
        lines.append(
            f"{verb} {len(temps)} temporary files of dead writers" + (":" if listed else "")
        )
        lines += [f"  {t.relpath}" for t in temps] if listed else []
    if plan.live_temps:
        lines.append(f"left alone: {plan.live_temps} temporary files of live or other-host writers")
    lines += [f"not entered (a symbolic link where a rank directory goes): {link}"
              for link in plan.links]  # fmt: skip
    if result is not None:
        if result.vanished:
            lines.append(f"{result.vanished} blocks had gone already")
        lines += [f"could not delete: {failure}" for failure in result.failed]
    return "\n".join(lines)


def gc_json(plan: GcPlan, result: GcResult | None) -> dict[str, Any]:
    blocks = plan.victims if result is None else result.deleted
    temps = plan.temps if result is None else result.temps_removed
    return {
        "location": plan.location,
        "namespaces": plan.namespaces,
        "max_bytes": plan.max_bytes,
        "dry_run": result is None,
        "blocks": plan.blocks,
        "bytes": plan.bytes,
        "deleted" if result is not None else "would_delete": [
            {"path": b.relpath, "bytes": b.size, "mtime": _iso(b.mtime_ns)} for b in blocks
        ],
        "freed_bytes": sum(b.size for b in blocks),
        "temp_files": [t.relpath for t in temps],
        "temp_files_left": plan.live_temps,
        "links_not_entered": plan.links,
        "vanished": 0 if result is None else result.vanished,
        "failed": [] if result is None else result.failed,
    }


# -- regions ---------------------------------------------------------------------------------


def regions_text(
    directory: str, regions: Sequence[RegionInfo], removed: Sequence[str], kept: Sequence[str]
) -> str:
    if not regions and not removed:
        return f"{directory}: no kvtier regions"
    lines = [f"{directory}: {len(regions)} kvtier region{'' if len(regions) == 1 else 's'}"]
    for region in regions:
        lines.append(f"  {region.instance_id}  {format_size(region.size)}  {_layout(region)}")
        lines.append(
            f"    owner: {_owner_text(region)}; mapped: {_mapped_text(region.mapped)}"
            + ("; STALE" if region.stale else "")
        )
    lines += [f"removed: {path}" for path in removed]
    lines += [f"kept (stale, but a live process still maps it): {path}" for path in kept]
    stale = [r for r in regions if r.stale and r.path not in removed]
    if stale and not removed and not kept:
        lines.append(f"{len(stale)} stale: kvtier regions --remove-stale deletes those nobody maps")
    return "\n".join(lines)


def _layout(region: RegionInfo) -> str:
    record = region.record
    if record is None:
        return "layout unknown (no owner record)"
    return (
        f"{record.num_slots} slots x {record.num_workers} workers, "
        f"{format_size(record.row_bytes)} rows"
    )


def _owner_text(region: RegionInfo) -> str:
    record = region.record
    if record is None:
        return "no owner record"
    started = (
        ""
        if region.started is None
        else (f", started {region.started.astimezone().strftime('%Y-%m-%d %H:%M:%S')}")
    )
    where = {"alive": "alive", "dead": "dead", "foreign": "in another pid namespace"}
    return f"pid {record.pid} {where[region.owner]}{started}"


def _mapped_text(mapped: bool | None) -> str:
    return {True: "yes", False: "no", None: "not tested"}[mapped]


def regions_json(
    directory: str, regions: Sequence[RegionInfo], removed: Sequence[str], kept: Sequence[str]
) -> dict[str, Any]:
    return {
        "directory": directory,
        "regions": [
            {
                "path": r.path,
                "instance_id": r.instance_id,
                "size": r.size,
                "mode": f"{r.mode:04o}",
                "uid": r.uid,
                "owner": r.owner,
                "pid": None if r.record is None else r.record.pid,
                "started": None if r.started is None else r.started.isoformat(),
                "num_slots": None if r.record is None else r.record.num_slots,
                "num_workers": None if r.record is None else r.record.num_workers,
                "row_bytes": None if r.record is None else r.record.row_bytes,
                "mapped": r.mapped,
                "stale": r.stale,
            }
            for r in regions
        ],
        "removed": list(removed),
        "kept": list(kept),
    }
