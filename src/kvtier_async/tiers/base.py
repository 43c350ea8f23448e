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

Counting: each tier owns one `kvtier_async.ledger.TierCounters` (``counters``), which the
tiering ledger and the engine's lanes for the tier are handed too; a tier adds to it only
what it alone sees (``written``: blocks a store wrote; ``present``: blocks it found stored
already) and reports its own state in `statistics` (its kind's figures: what it holds,
its breaker, what it deleted on its own).

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
from typing import Any, ClassVar, Self

from pydantic import ConfigDict, PrivateAttr

from kvtier_async._extras import S3 as S3_MODULES
from kvtier_async._extras import MissingExtraError, require
from kvtier_async.config import ConfigError, ConfigModel, NonEmptyStr, field_path, parse
from kvtier_async.ledger import TierCounters

__all__ = [
    "FORMAT_VERSION",
    "OpenTierConfig",
    "SecondaryTier",
    "TierConfig",
    "TierContext",
    "TierStatistics",
    "make_tier",
    "register_tier",
    "tier_config",
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
    """A tier's own state: how it runs, what it holds; a kind's subclass adds its figures.
    The events every tier has (lookups, hits, blocks and bytes moved, failures) are in its
    `TierCounters`, each counted once, not here."""

    name: str
    kind: str
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
        self.counters = TierCounters()  # shared with the ledger and the lanes (see above)

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
        """The tier's state, and in ``detail`` how it runs (e.g. O_DIRECT or buffered)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


class TierConfig(ConfigModel):
    """One entry of ``secondary_tiers``: its ``type`` and ``name``; each kind's model adds its
    own fields (`kvtier_async.tiers.fs.FsTierConfig`, ...). A kind registered without a model
    gets `OpenTierConfig`, which keeps every other key for its factory to read."""

    type: NonEmptyStr
    name: NonEmptyStr
    _path: str = PrivateAttr("")  # where it came from (``secondary_tiers[1]``), for messages

    @property
    def path(self) -> str:
        """Where this entry came from (``secondary_tiers[1]``), for messages; see `at`."""
        return self._path

    def at(self, path: str) -> Self:
        """A copy of this config that names itself ``path`` in messages (the caller's model
        is left as it was)."""
        located = self.model_copy()
        located._path = path
        return located

    def field(self, key: str) -> str:
        """The full name of this tier's config field ``key`` (``secondary_tiers[1].bucket``)."""
        return field_path(self.path, key)


class OpenTierConfig(TierConfig):
    """The config of a tier kind registered without a model: any other keys, unchecked."""

    model_config = ConfigDict(extra="allow")


TierFactory = Callable[[Any, str, TierContext], SecondaryTier]
# kind -> (its config model, its factory), each as "module:attribute" until first used
_FACTORIES: dict[str, tuple[str | type[TierConfig], str | TierFactory]] = {
    "memory": (
        "kvtier_async.tiers.memory:MemoryTierConfig",
        "kvtier_async.tiers.memory:from_config",
    ),
    "fs": ("kvtier_async.tiers.fs:FsTierConfig", "kvtier_async.tiers.fs:from_config"),
    "obj": ("kvtier_async.tiers.s3.config:ObjTierConfig", "kvtier_async.tiers.s3:from_config"),
}


def register_tier(
    kind: str, factory: str | TierFactory, config: str | type[TierConfig] = OpenTierConfig
) -> None:
    """Make ``{"type": kind, ...}`` a tier: its entry is validated as ``config`` (a
    `TierConfig` subclass) and built with ``factory(config, name, ctx)``."""
    _FACTORIES[kind] = (config, factory)


def tier_config(data: object, path: str) -> TierConfig:
    """One ``secondary_tiers`` entry validated by its kind's model; ``path`` names it in
    errors (``secondary_tiers[0]``). Its ``name`` defaults to the kind and the entry's index
    (``fs[0]``)."""
    if not isinstance(data, Mapping):
        raise ConfigError(path, f"must be a mapping (JSON object), got {type(data).__name__}")
    kind = data.get("type")
    if not isinstance(kind, str) or kind not in _FACTORIES:
        got = repr(kind) if "type" in data else "nothing"
        raise ConfigError(
            field_path(path, "type"), f"must be one of {sorted(_FACTORIES)}, got {got}"
        )
    model: type[TierConfig] = _load(kind, 0, path)
    default_name = f"{kind}{path[path.rfind('[') :] if path.endswith(']') else ''}"
    return parse(model, {"name": default_name, **data}, path).at(path)


def make_tier(
    config: TierConfig | Mapping[str, Any], ctx: TierContext, path: str = ""
) -> SecondaryTier:
    """Build one tier from its validated config (or a raw mapping, validated first, named
    ``path`` in errors)."""
    cfg = config if isinstance(config, TierConfig) else tier_config(config, path)
    factory: TierFactory = _load(cfg.type, 1, cfg.path)
    return factory(cfg, cfg.name, ctx)


def _load(kind: str, which: int, path: str) -> Any:
    """The config model (``which`` 0) or the factory (1) of ``kind``, imported on first use."""
    entry = _FACTORIES[kind]
    target = entry[which]
    if isinstance(target, str):
        module_name, _, attr = target.partition(":")
        if kind == "obj":
            try:
                require("s3", S3_MODULES, f"tier {kind!r}")
            except MissingExtraError as exc:
                raise ConfigError(field_path(path, "type"), str(exc)) from None
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError(
                field_path(path, "type"), f"tier {kind!r} is unavailable: {exc}"
            ) from exc
        target = getattr(module, attr)
        _FACTORIES[kind] = (target, entry[1]) if which == 0 else (entry[0], target)
    return target
