"""What the operations return: a verification, a GC plan and its outcome.

Plain data, the same for an fs root and a bucket; `kvtier_async.ops.render` shows them as text
or JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier_async.ops.layout import Block, Temp

__all__ = ["Damage", "Disagreement", "GcPlan", "GcResult", "Verification"]


@dataclass(frozen=True)
class Damage:
    """A block file (or object) that failed a check, and why. ``identity``: the (device,
    inode) that was judged, so a repair deletes only that file."""

    relpath: str
    reason: str
    identity: tuple[int, int] | None = None


@dataclass(frozen=True)
class Disagreement:
    """A block sound by its own header whose payload length (``payload``) is not the
    ``block_bytes`` its namespace's ``config.json`` gives (``configured``): not damage."""

    relpath: str
    payload: int
    configured: int


@dataclass
class Verification:
    """The outcome of reading every block: ``checked`` of ``total`` (those found by the walk
    or listing); ``vanished``: deleted before they were read (a live instance); ``errors``:
    could not be read, so not judged (permissions, I/O errors, an unanswered request)."""

    total: int
    checked: int = 0
    good: int = 0
    bytes_read: int = 0
    vanished: int = 0
    seconds: float = 0.0
    damaged: list[Damage] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    disagree: list[Disagreement] = field(default_factory=list)  # config.json contradicts
    removed: list[Damage] = field(default_factory=list)  # by --repair
    kept: list[Damage] = field(default_factory=list)  # --repair could not delete them
    repair_refused: bool = False  # --repair deleted nothing: config.json disagrees

    def record(
        self, relpath: str, outcome: Damage | Disagreement | str | None, nbytes: int
    ) -> None:
        """One block's outcome: None (good), ``"vanished"``, an error text, a `Damage` or a
        `Disagreement`."""
        self.checked += 1
        self.bytes_read += nbytes
        if outcome is None:
            self.good += 1
        elif outcome == "vanished":
            self.vanished += 1
        elif isinstance(outcome, Damage):
            self.damaged.append(outcome)
        elif isinstance(outcome, Disagreement):
            self.disagree.append(outcome)
        else:
            self.errors.append(outcome)

    @property
    def repaired(self) -> bool:
        """Whether no damage is left (none found, or all of it removed)."""
        return not self.damaged or (bool(self.removed) and not self.kept)


@dataclass
class GcPlan:
    """What a GC deletes: ``victims`` (oldest first) of ``blocks`` blocks of ``bytes``
    under ``location`` (of ``namespaces``, or all), and the temporaries of dead writers
    (``live_temps``: those it leaves); ``links``: links found where rank directories go,
    never entered."""

    location: str
    max_bytes: int
    namespaces: list[str] | None
    blocks: int = 0
    bytes: int = 0
    victims: list[Block] = field(default_factory=list)
    temps: list[Temp] = field(default_factory=list)
    live_temps: int = 0
    links: list[str] = field(default_factory=list)

    @property
    def freed(self) -> int:
        return sum(block.size for block in self.victims)


@dataclass
class GcResult:
    """What a GC deleted, what had gone already, and what it could not delete."""

    plan: GcPlan
    deleted: list[Block] = field(default_factory=list)
    vanished: int = 0
    failed: list[str] = field(default_factory=list)
    temps_removed: list[Temp] = field(default_factory=list)

    @property
    def freed(self) -> int:
        return sum(block.size for block in self.deleted)
