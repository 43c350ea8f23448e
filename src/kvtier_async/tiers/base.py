"""The secondary-tier contract, the tier context, and the tier factory.

A secondary tier moves whole blocks between primary-tier memory and its own storage. It
sees keys and memory, never the ledger: the engine calls it from its worker tasks and turns
every call into a job result that the ledger's owner applies.

Preconditions (guaranteed by the engine):

- ``open`` is awaited once before any other call, ``aclose`` once at the end (also after a
  failed ``open``).
- At most ``read_workers`` ``load`` calls and ``write_workers`` ``store`` calls run at
  once; ``lookup`` calls run one at a time.
- Every block memoryview is 1-D, unsigned bytes, exactly ``ctx.block_bytes`` long, starts
  on a page boundary and is not touched by anyone else until the call returns (a ``load``
  target is a slot reserved for it; a ``store`` source is pinned).
- A call may be cancelled; it must then leave no partial object under the final name.

Every method is a coroutine that never blocks the event loop: blocking system calls run in
worker threads (``anyio.to_thread.run_sync``). A tier reports per-key outcomes; it raises
only when the whole call failed (the engine then fails every key of the job).

A block's name below a tier's root is `block_relpath` (`kvtier_async.tiers.blockfile`, with
the block file format), the same for fs and obj.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from kvtier_async._extras import S3 as S3_MODULES
from kvtier_async._extras import MissingExtraError, require
from kvtier_async.config import ConfigError, Section

__all__ = [
    "FORMAT_VERSION",
    "SecondaryTier",
    "TierContext",
    "TierStatistics",
    "make_tier",
    "register_tier",
]

FORMAT_VERSION = 1


@dataclass(frozen=True)
class TierContext:
    """What a tier needs to know about the blocks it keeps.

    Every field but ``instance_id`` changes the bytes of a block, so `namespace` digests
    them: two configurations never share stored blocks.
    """

    block_bytes: int
    model: str = "kvtier-demo"
    block_tokens: int = 16
    dtype: str = "float16"
    kv_layout: str = "bytes"
    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0
    format_version: int = FORMAT_VERSION
    instance_id: str = "kvtier"

    def namespace_fields(self) -> dict[str, Any]:
        fields = asdict(self)
        del fields["instance_id"], fields["rank"]
        return fields

    @functools.cached_property
    def namespace(self) -> str:
        """``<model>_<digest>``: a directory / object-prefix name, safe for any model name."""
        blob = json.dumps(self.namespace_fields(), sort_keys=True).encode()
        digest = hashlib.sha256(blob).hexdigest()[:12]
        model = "".join(c if c.isalnum() or c in "-_." else "-" for c in self.model)
        return f"{model.strip('.') or 'model'}_{digest}"


@dataclass(frozen=True)
class TierStatistics:
    """Counters a tier keeps; the engine adds its own (jobs, queue depth)."""

    name: str
    kind: str
    blocks_stored: int = 0
    blocks_loaded: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    store_failures: int = 0
    load_failures: int = 0
    lookups: int = 0
    lookup_hits: int = 0
    detail: str = ""
    used_bytes: int | None = None  # bytes the tier holds, where it keeps count (max_bytes)
    max_bytes: int | None = None  # its capacity, where it has one


class SecondaryTier(ABC):
    """A secondary tier backend (see the module docstring for the contract)."""

    kind: ClassVar[str]

    def __init__(self, name: str, ctx: TierContext, read_workers: int, write_workers: int) -> None:
        self.name = name
        self.ctx = ctx
        self.read_workers = read_workers
        self.write_workers = write_workers

    async def open(self) -> None:  # noqa: B027 - optional hook
        """Prepare (probe the storage, clean up leftovers). Raise with a clear message."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release every resource; idempotent."""

    @abstractmethod
    async def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored (a batched existence check)."""

    @abstractmethod
    async def store(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        """Write each block unless its key is stored already; per key, whether it is stored
        afterwards, complete and verifiable."""

    @abstractmethod
    async def load(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        """Read each key into its block; per key, whether every byte arrived and verified.
        A key that fails must not be reported stored by later lookups (delete it)."""

    def take_removed(self) -> list[bytes]:
        """Keys this tier deleted on its own since the last call (a block that failed
        verification, or garbage collection such as the fs tier's ``max_bytes``), oldest
        first, so the owner can report them (KV events). Non-blocking; the default: none."""
        return []

    @abstractmethod
    def statistics(self) -> TierStatistics:
        """Counters, and in ``detail`` how the tier runs (e.g. O_DIRECT or buffered)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


TierFactory = Callable[[Section, str, TierContext], SecondaryTier]
_FACTORIES: dict[str, str | TierFactory] = {
    "memory": "kvtier_async.tiers.memory:from_config",
    "fs": "kvtier_async.tiers.fs:from_config",
    "obj": "kvtier_async.tiers.s3:from_config",
}


def register_tier(kind: str, factory: str | TierFactory) -> None:
    """Make ``{"type": kind, ...}`` build a tier with ``factory(section, name, ctx)``."""
    _FACTORIES[kind] = factory


def make_tier(config: Mapping[str, Any], ctx: TierContext, path: str) -> SecondaryTier:
    """Build one tier from its config mapping; ``path`` names it in errors
    (``secondary_tiers[0]``)."""
    section = Section(config, path)
    kind = section.get_str("type", choices=sorted(_FACTORIES))
    name = section.get_str("name", f"{kind}{path[path.find('[') :] if '[' in path else ''}")
    return _factory(kind, section)(section, name, ctx)


def _factory(kind: str, section: Section) -> TierFactory:
    factory = _FACTORIES[kind]
    if isinstance(factory, str):
        module_name, _, attr = factory.partition(":")
        if kind == "obj":
            try:
                require("s3", S3_MODULES, f"tier {kind!r}")
            except MissingExtraError as exc:
                raise ConfigError(section.name("type"), str(exc)) from None
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError(section.name("type"), f"tier {kind!r} is unavailable: {exc}") from exc
        factory = _FACTORIES[kind] = getattr(module, attr)
    return factory
