"""``kvtier plan --trace FILE``: how big to make the CPU tier, from a trace of your traffic.

Replays the trace (`kvtier_async.ops.traces`: the Mooncake format or kvtier's own JSONL)
through the CPU tier's ledger with each eviction policy, at a range of capacities, the way
vLLM 0.33's scheduler calls its offloading manager (our ``lru`` and ``arc`` make exactly its
decisions), and reports the hit rate at each: the share of block lookups served from the CPU
tier (per request, the leading blocks held until the first miss). Two bounds frame them:
Belady's offline optimum at the same capacity (it knows the future, so no policy beats it)
and the infinite cache (every block ever seen kept: what reuse the trace has at all).

Capacity is counted in blocks and, given ``--block-bytes`` (one block's KV bytes: the
model's bytes per token times the tokens in a block), in bytes: the ``cpu_bytes_to_use`` to
configure. Read the curve for where it flattens: past the point where the best policy nears
the infinite cache, more memory buys nothing on this traffic.

Nothing here touches the network; the trace is read once, and every replay is pure Python
on this thread (about a second per million block accesses and policy).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvtier_async.bench.ledger import Trace, belady_hit_rate, infinite_hit_rate, policy_hit_rate
from kvtier_async.ops.traces import TraceFile

__all__ = [
    "DEFAULT_FRACTIONS",
    "DEFAULT_POLICIES",
    "Plan",
    "PlanPoint",
    "make_plan",
    "parse_capacities",
    "plan_json",
    "render_plan",
    "write_plot",
]

DEFAULT_FRACTIONS = (0.01, 0.02, 0.05, 0.10, 0.15, 0.20, 0.25, 0.35, 0.50)
DEFAULT_POLICIES = ("lru", "arc", "prefix", "reuse", "sieve", "s3fifo", "tinylfu", "adaptive")
NEAR = 0.95  # "near the infinite cache": this share of its hit rate


@dataclass(frozen=True)
class PlanPoint:
    """One capacity: its size, each policy's hit rate, and Belady's optimum there."""

    blocks: int
    fraction: float  # of the trace's distinct blocks
    cpu_bytes: int | None  # blocks times --block-bytes, when given
    hit_rates: dict[str, float]  # policy -> hit rate
    belady: float


@dataclass(frozen=True)
class Plan:
    trace: str
    format: str
    requests: int
    accesses: int
    distinct_blocks: int
    block_bytes: int | None
    infinite: float  # the infinite cache's hit rate
    points: list[PlanPoint]

    def best(self, point: PlanPoint) -> tuple[str, float]:
        """The policy with the highest hit rate at ``point`` (the first listed on a tie)."""
        return max(point.hit_rates.items(), key=lambda item: item[1])

    def knee(self) -> PlanPoint | None:
        """The smallest capacity where the best policy reaches `NEAR` of the infinite
        cache's hit rate (None: none of the capacities asked for does)."""
        for point in self.points:
            if self.infinite and self.best(point)[1] >= NEAR * self.infinite:
                return point
        return None

    def as_dict(self) -> dict[str, Any]:
        knee = self.knee()
        return {**asdict(self), "near": NEAR, "knee_blocks": knee.blocks if knee else None}


def parse_capacities(text: str) -> list[str]:
    """``"5%,10%,20000"``: each a share of the distinct blocks (``%``) or a block count.
    ValueError names the bad item."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ValueError("expected a comma-separated list such as 5%,10%,20000")
    for item in items:
        try:
            value = float(item[:-1]) if item.endswith("%") else int(item)
        except ValueError:
            raise ValueError(f"{item!r}: expected a percentage (10%) or a block count") from None
        if value <= 0 or (item.endswith("%") and value > 100):
            raise ValueError(f"{item!r}: must be above 0 (a percentage at most 100%)")
    return items


def make_plan(
    source: TraceFile,
    *,
    capacities: Sequence[str] | None = None,
    policies: Sequence[str] = DEFAULT_POLICIES,
    block_bytes: int | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> Plan:
    """Replay ``source`` with each policy at each capacity (default: `DEFAULT_FRACTIONS` of
    its distinct blocks); ``progress`` hears one line per capacity."""
    trace = Trace.of(source.requests)
    if not trace.unique_blocks:
        raise ValueError(f"{source.name}: the trace has no blocks")
    sizes = _sizes(trace, capacities)
    points = []
    for n, blocks in enumerate(sizes, 1):
        progress(f"plan: {n}/{len(sizes)}: {blocks:,} blocks: {', '.join(policies)}, belady")
        rates = {p: policy_hit_rate(trace, p, blocks) for p in policies}
        points.append(
            PlanPoint(
                blocks=blocks,
                fraction=blocks / trace.unique_blocks,
                cpu_bytes=blocks * block_bytes if block_bytes else None,
                hit_rates=rates,
                belady=belady_hit_rate(trace, blocks),
            )
        )
    return Plan(
        trace=source.name,
        format=source.format,
        requests=len(trace.requests),
        accesses=sum(len(keys) for keys in trace.requests),
        distinct_blocks=trace.unique_blocks,
        block_bytes=block_bytes,
        infinite=infinite_hit_rate(trace),
        points=points,
    )


def _sizes(trace: Trace, capacities: Sequence[str] | None) -> list[int]:
    if capacities is None:
        sizes = [trace.capacity_at(f) for f in DEFAULT_FRACTIONS]
    else:
        sizes = [
            trace.capacity_at(float(c[:-1]) / 100) if c.endswith("%") else int(c)
            for c in capacities
        ]
    return sorted(set(sizes))


def render_plan(plan: Plan, size: Callable[[int], str]) -> str:
    """The plan as a table for a person; ``size`` renders a byte count."""
    policies = list(plan.points[0].hit_rates) if plan.points else []
    head = ["blocks", "% of distinct"]
    if plan.block_bytes:
        head.append("cpu_bytes_to_use")
    head += [*policies, "belady", "best", "best/infinite"]
    rows = [head]
    for point in plan.points:
        row = [f"{point.blocks:,}", f"{point.fraction:.1%}"]
        if point.cpu_bytes is not None:
            row.append(size(point.cpu_bytes))
        row += [f"{point.hit_rates[p]:.4f}" for p in policies]
        name, best = plan.best(point)
        share = best / plan.infinite if plan.infinite else 0.0
        row += [f"{point.belady:.4f}", name, f"{share:.0%}"]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [
        f"{plan.trace} ({plan.format}): {plan.requests:,} requests, {plan.accesses:,} block "
        f"lookups, {plan.distinct_blocks:,} distinct blocks; infinite cache hit rate "
        f"{plan.infinite:.4f}"
    ]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    knee = plan.knee()
    if knee is None:
        lines.append(
            f"no capacity asked for reaches {NEAR:.0%} of the infinite cache's hit rate: "
            "try larger ones (--capacities)"
        )
    else:
        name, _ = plan.best(knee)
        where = f"{knee.blocks:,} blocks"
        if knee.cpu_bytes is not None:
            where += f" (cpu_bytes_to_use {size(knee.cpu_bytes)})"
        lines.append(
            f"smallest capacity within {1 - NEAR:.0%} of the infinite cache: {where}, "
            f"with {name}; more memory than that gains little on this traffic"
        )
    if not plan.block_bytes:
        lines.append("give --block-bytes (one block's KV bytes) to see cpu_bytes_to_use")
    return "\n".join(lines)


def plan_json(plan: Plan) -> str:
    return json.dumps(plan.as_dict(), indent=2)


def write_plot(plan: Plan, path: str | Path, size: Callable[[int], str] = str) -> str:
    """A PNG: hit rate against capacity (log scale), one line per policy, the two bounds
    dashed, the knee marked; with ``block_bytes``, a top axis in bytes (``size`` renders
    them)."""
    from kvtier_async.bench.plot import pyplot

    plt = pyplot()
    from matplotlib.ticker import FixedLocator, FuncFormatter

    figure, axes = plt.subplots(figsize=(8.0, 4.8))
    xs = [p.blocks for p in plan.points]
    for policy in plan.points[0].hit_rates if plan.points else []:
        axes.plot(xs, [p.hit_rates[policy] for p in plan.points], marker="o", label=policy)
    axes.plot(xs, [p.belady for p in plan.points], "k--", label="Belady (offline optimum)")
    axes.axhline(plan.infinite, color="grey", linestyle=":", label="infinite cache")
    knee = plan.knee()
    if knee is not None:
        axes.axvline(knee.blocks, color="grey", alpha=0.5, label=f"{NEAR:.0%} of infinite")
    axes.set_xscale("log")
    axes.set_xlabel("CPU tier capacity (blocks)")
    axes.set_ylabel("hit rate (block lookups served by the CPU tier)")
    axes.set_title(f"kvtier plan: {plan.trace} ({plan.requests:,} requests)")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="lower right")
    block = plan.block_bytes
    if block:
        top = axes.secondary_xaxis("top", functions=(lambda b: b * block, lambda n: n / block))
        # ticks at the capacities tried (every other one when crowded): a log axis of bytes
        # spanning less than a decade or two would otherwise get one tick or none
        marked = xs if len(xs) <= 6 else xs[::2]
        top.xaxis.set_major_locator(FixedLocator([blocks * block for blocks in marked]))
        top.xaxis.set_major_formatter(FuncFormatter(lambda value, _: size(int(value))))
        top.xaxis.set_minor_formatter(FuncFormatter(lambda value, _: ""))
        top.set_xlabel(f"cpu_bytes_to_use ({size(block)} a block)")
    out = Path(path)
    out.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    figure.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(figure)
    os.chmod(out, 0o600)
    return str(out)
