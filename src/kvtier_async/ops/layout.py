"""What a tier root holds, told apart by name alone: the same for a directory and a bucket.

Both tiers name block ``key`` ``<model>_<digest>/r<rank>/<hhh>/<hh>_g<group>/<hex key>.bin``
below their root (`kvtier_async.tiers.blockfile.block_relpath`), and the fs tier writes
``<model>_<digest>/config.json`` beside a namespace's rank directories. `classify` sorts one
relative name into a namespace's config, a block, a named temporary of the fs tier
(`kvtier_async.tiers.fs.tempfiles`), or something else; `Root` gathers the results of a walk
or a listing, and `RankSummary` what the report shows per rank.

*Verdicts.* `check_block` judges the bytes of one block file against the key its name
gives, in the order the tiers' readers check (the length first, then
`kvtier_async.tiers.blockfile.verify_block`), with their words: ``short file``, ``file is N
bytes``, ``header checksum mismatch``... The payload length is the namespace's
``block_bytes`` (``config.json``) where known; otherwise the header's own claim if the
header's checksum holds (a bucket the obj tier filled has no ``config.json``), else the
file's size. A block sound by its own header whose length ``config.json`` contradicts is
never called damaged: the verdict is that ``config.json`` disagrees, and ``--repair`` then
deletes nothing (a wrong ``config.json`` must not cost every good block).

*Eviction order.* `lru_victims` is the fs tier's ``max_bytes`` GC applied to a list: the
tier's own access record (`kvtier_async.tiers.fs.records.Usage`) seeded in modification order,
then trimmed, oldest first. The tier keeps its newest file; a tool asked for less (``0``: drop
them all) takes that one too.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from kvtier_async.tiers.blockfile import (
    HEADER_BYTES,
    HEADER_SUM_AT,
    CorruptBlockError,
    short_file,
    stored_length,
    verify_block,
    wrong_size,
)
from kvtier_async.tiers.checksum import checksum
from kvtier_async.tiers.fs.records import Usage
from kvtier_async.tiers.fs.tempfiles import TEMP_RE

__all__ = [
    "CONFIG_NAME",
    "NAMESPACE_RE",
    "RANK_RE",
    "Block",
    "Namespace",
    "OpsError",
    "RankSummary",
    "Root",
    "Temp",
    "check_block",
    "classify",
    "lru_victims",
    "pick_namespace",
    "too_large",
]

CONFIG_NAME: Final = "config.json"
NAMESPACE_RE: Final = re.compile(r"(?P<model>.+)_(?P<digest>[0-9a-f]{12})")
RANK_RE: Final = re.compile(r"r(\d+)")
# A payload larger than this is no block (a 70B model's block at 64 tokens is ~20 MiB).
_MAX_PAYLOAD: Final = 1 << 30
_SUM: Final = struct.Struct("<Q")


class OpsError(Exception):
    """A bad path, URL or argument: the message says what is wrong (the command exits 2)."""


@dataclass(frozen=True, slots=True)
class Block:
    """A block file (or object): its name below the root, size and modification time."""

    relpath: str
    rank: int
    size: int
    mtime_ns: int


@dataclass(frozen=True, slots=True)
class Temp:
    """A named temporary of the fs tier, and what is known of its writer: ``live``,
    ``dead``, ``foreign`` (another host or pid namespace: not judged) or ``unknown`` (an
    object in a bucket: no process to ask)."""

    relpath: str
    size: int
    writer: str


@dataclass
class Namespace:
    """One ``<model>_<digest>`` directory (or prefix) and what is in it."""

    name: str
    config: dict[str, Any] | None = None
    config_note: str = ""
    blocks: list[Block] = field(default_factory=list)
    temps: list[Temp] = field(default_factory=list)
    others: list[str] = field(default_factory=list)  # neither config, block nor temporary
    links: list[str] = field(default_factory=list)  # a block name that is no regular file

    @property
    def model(self) -> str:
        """The model, as ``config.json`` records it, else as the name gives it (sanitised)."""
        if self.config is not None and isinstance(self.config.get("model"), str):
            return str(self.config["model"])
        match = NAMESPACE_RE.fullmatch(self.name)
        return match["model"] if match else self.name

    @property
    def digest(self) -> str:
        match = NAMESPACE_RE.fullmatch(self.name)
        return match["digest"] if match else ""

    @property
    def block_bytes(self) -> int | None:
        """The payload length ``config.json`` gives, if it gives a sane one."""
        value = None if self.config is None else self.config.get("block_bytes")
        ok = isinstance(value, int) and not isinstance(value, bool) and 0 < value <= _MAX_PAYLOAD
        return value if ok else None

    def ranks(self) -> list[RankSummary]:
        """Per rank: blocks, bytes, oldest and newest, in rank order."""
        summaries: dict[int, RankSummary] = {}
        for block in self.blocks:
            summary = summaries.setdefault(block.rank, RankSummary(block.rank))
            summary.add(block)
        return [summaries[rank] for rank in sorted(summaries)]


@dataclass
class RankSummary:
    rank: int
    blocks: int = 0
    bytes: int = 0
    oldest_ns: int | None = None
    newest_ns: int | None = None

    def add(self, block: Block) -> None:
        self.blocks += 1
        self.bytes += block.size
        if self.oldest_ns is None or block.mtime_ns < self.oldest_ns:
            self.oldest_ns = block.mtime_ns
        if self.newest_ns is None or block.mtime_ns > self.newest_ns:
            self.newest_ns = block.mtime_ns


@dataclass
class Root:
    """What a walk of a root directory, or a listing of a bucket prefix, found."""

    location: str  # the path or ``s3://bucket/prefix`` as given
    kind: str  # "fs" or "s3"
    namespaces: dict[str, Namespace] = field(default_factory=dict)
    others: list[str] = field(default_factory=list)  # outside any namespace

    def namespace(self, name: str) -> Namespace:
        found = self.namespaces.get(name)
        if found is None:
            found = self.namespaces[name] = Namespace(name)
        return found

    def sorted_namespaces(self) -> list[Namespace]:
        return [self.namespaces[name] for name in sorted(self.namespaces)]

    def add(self, relpath: str, size: int, mtime_ns: int, *, regular: bool, writer: str) -> None:
        """Record the entry at ``relpath`` (``regular``: a plain file or an object; ``writer``:
        the state of a temporary's writer, if it is one)."""
        kind, namespace, rank = classify(relpath)
        if kind == "other" and namespace is None:
            self.others.append(relpath)
            return
        assert namespace is not None
        ns = self.namespace(namespace)
        if kind == "block" and regular:
            ns.blocks.append(Block(relpath, rank, size, mtime_ns))
        elif kind == "block":
            ns.links.append(relpath)
        elif kind == "temp":
            ns.temps.append(Temp(relpath, size, writer))
        elif kind == "other":
            ns.others.append(relpath)


def classify(relpath: str) -> tuple[str, str | None, int]:
    """``(kind, namespace, rank)`` of the name ``relpath`` below a root: kind ``config``,
    ``block``, ``temp`` or ``other`` (namespace None: outside any namespace; rank -1 where
    there is none)."""
    parts = relpath.split("/")
    if len(parts) < 2 or not NAMESPACE_RE.fullmatch(parts[0]):
        return "other", None, -1
    name = parts[-1]
    if len(parts) == 2 and name == CONFIG_NAME:
        return "config", parts[0], -1
    if TEMP_RE.fullmatch(name):
        return "temp", parts[0], -1
    rank = RANK_RE.fullmatch(parts[1])
    if len(parts) >= 3 and rank and name.endswith(".bin"):
        return "block", parts[0], int(rank[1])
    return "other", parts[0], -1


def pick_namespace(location: str, names: Sequence[str], wanted: str) -> str:
    """Of ``names`` (namespaces under ``location``), the one called ``wanted`` or whose
    digest it is; `OpsError` naming those there are if none is."""
    for name in names:
        match = NAMESPACE_RE.fullmatch(name)
        if name == wanted or (match is not None and match["digest"] == wanted):
            return name
    there = ", ".join(names) or "none"
    raise OpsError(
        f"--model {wanted}: no namespace with that digest in {location} (there: {there})"
    )


# -- verdicts --------------------------------------------------------------------------------


def check_block(data: memoryview, key: bytes, block_bytes: int | None) -> int | None:
    """Raise `CorruptBlockError` unless ``data`` (a whole file or object) is ``key``'s block.

    It is judged with a payload of ``block_bytes`` first, as the tier reads it (None: see
    the module docstring). A block that fails only that, being sound by its own header (its
    checksums hold for the payload length it claims), is no damage: ``config.json``
    disagrees with it, and its own payload length is returned. None when it is good."""
    try:
        _judge(data, key, block_bytes)
    except CorruptBlockError as exc:
        if block_bytes is None:
            raise
        try:
            _judge(data, key, None)
        except CorruptBlockError:
            raise exc from None
        return _claimed_payload(data)
    return None


def _judge(data: memoryview, key: bytes, block_bytes: int | None) -> None:
    size = data.nbytes
    payload = block_bytes if block_bytes is not None else _claimed_payload(data)
    expected = HEADER_BYTES + payload
    if size < expected:
        raise short_file(size, expected)
    if size > expected:
        raise wrong_size(size, expected)
    verify_block(data[:HEADER_BYTES], key, data[HEADER_BYTES:])


def _claimed_payload(data: memoryview) -> int:
    """The header's payload length if its checksum holds and it is sane, else the rest of
    ``data`` (`verify_block` then names what is wrong)."""
    rest = max(0, data.nbytes - HEADER_BYTES)
    if data.nbytes < HEADER_BYTES:
        return rest
    (header_sum,) = _SUM.unpack_from(data, HEADER_SUM_AT)
    if checksum(data[:HEADER_SUM_AT]) != header_sum:
        return rest
    claimed = stored_length(data)
    return claimed if 0 < claimed <= _MAX_PAYLOAD else rest


def too_large(size: int) -> CorruptBlockError | None:
    """The verdict on a file or object too large to be any block, without reading it."""
    if size > HEADER_BYTES + _MAX_PAYLOAD:
        return wrong_size(size, HEADER_BYTES + _MAX_PAYLOAD)
    return None


# -- eviction order --------------------------------------------------------------------------


def lru_victims(blocks: Iterable[Block], max_bytes: int) -> list[Block]:
    """The blocks the fs tier's ``max_bytes`` GC would delete to bring ``blocks`` to at most
    ``max_bytes``, oldest first (see the module docstring)."""
    by_path = {block.relpath: block for block in blocks}
    usage = Usage(max_bytes)
    usage.seed([_order(block) for block in by_path.values()])
    victims = [by_path[path] for path in usage.trim()]
    if usage.used > max_bytes:  # the tier keeps its newest file; asked for less, take it
        victims.append(max(by_path.values(), key=_order))
    return victims


def _order(block: Block) -> tuple[int, str, int]:
    """A block's place in `Usage.seed`'s order: modification time, then name."""
    return block.mtime_ns, block.relpath, block.size
