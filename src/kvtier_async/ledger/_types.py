"""Plain data shared by the ledger, the engine and the tiers.

Keys are raw ``bytes`` (block hash + 4-byte big-endian group index), so they hash and
compare as bytes on the hot path; specs are small, picklable descriptions of transfers
(numpy int64 arrays where vLLM uses them) that cross thread and process boundaries.
"""

from __future__ import annotations

import enum
import itertools
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NewType, cast

import numpy as np
import numpy.typing as npt

__all__ = [
    "CPUSpec",
    "GPUSpec",
    "JobKind",
    "LedgerError",
    "LookupResult",
    "Medium",
    "OffloadKey",
    "OffloadingEvent",
    "PrepareStoreOutput",
    "TierSpec",
    "get_group_idx",
    "make_offload_key",
    "make_offload_keys",
    "split_offload_key",
]

OffloadKey = NewType("OffloadKey", bytes)
IntArray = npt.NDArray[np.int64]

_GROUP_BYTES = 4


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """Pack a block hash and a KV-cache group index into one key."""
    if not block_hash:
        raise ValueError("block_hash must not be empty")
    if not 0 <= group_idx < 1 << 32:
        raise ValueError(f"group_idx must be in [0, 2**32), got {group_idx}")
    return OffloadKey(block_hash + group_idx.to_bytes(_GROUP_BYTES, "big"))


def make_offload_keys(block_hashes: Iterable[bytes], group_idx: int) -> list[OffloadKey]:
    """`make_offload_key` of each hash, in order (the group index is checked once)."""
    if not 0 <= group_idx < 1 << 32:
        raise ValueError(f"group_idx must be in [0, 2**32), got {group_idx}")
    suffix = group_idx.to_bytes(_GROUP_BYTES, "big")
    hashes = block_hashes if isinstance(block_hashes, list) else list(block_hashes)
    if set(map(type, hashes)) <= {bytes}:  # vLLM's block hashes: concatenated in C
        keys = list(map(operator.add, hashes, itertools.repeat(suffix)))
    else:
        keys = [bytes(block_hash) + suffix for block_hash in hashes]
    if _GROUP_BYTES in map(len, keys):
        raise ValueError("block_hash must not be empty")
    return cast("list[OffloadKey]", keys)


def split_offload_key(key: bytes) -> tuple[bytes, int]:
    """Return ``(block_hash, group_idx)`` of a key built by `make_offload_key`."""
    if len(key) <= _GROUP_BYTES:
        raise ValueError(
            f"an offload key is a block hash and a {_GROUP_BYTES}-byte group index, so longer "
            f"than {_GROUP_BYTES} bytes; got {len(key)} bytes"
        )
    return key[:-_GROUP_BYTES], int.from_bytes(key[-_GROUP_BYTES:], "big")


def get_group_idx(key: bytes) -> int:
    """The KV-cache group index of a key."""
    return int.from_bytes(key[-_GROUP_BYTES:], "big")


class LookupResult(enum.Enum):
    """Answer of a lookup: MISS, HIT (readable now), HIT_PENDING (being written),
    RETRY (a slow tier has not answered yet; ask again next step)."""

    MISS = 0
    HIT = 1
    HIT_PENDING = 2
    RETRY = 3


class JobKind(enum.Enum):
    """What a job moves: every transfer, cascade, promotion and lookup is one of these."""

    STORE = "store"  # device -> CPU slot
    LOAD = "load"  # CPU slot -> device
    CASCADE = "cascade"  # CPU slot -> secondary tier
    PROMOTE = "promote"  # secondary tier -> CPU slot
    LOOKUP = "lookup"  # batched existence check in a secondary tier

    @property
    def is_read(self) -> bool:
        """Reads (loads, promotions, lookups) go before writes when both wait."""
        return self in (JobKind.LOAD, JobKind.PROMOTE, JobKind.LOOKUP)


class Medium(enum.StrEnum):
    """Where a block lives."""

    GPU = "GPU"
    CPU = "CPU"
    STORAGE = "STORAGE"


class LedgerError(RuntimeError):
    """A call broke the ledger's preconditions; the ledger's state is unchanged."""


def _as_ids(ids: object) -> IntArray:
    return np.asarray(ids, dtype=np.int64).reshape(-1)


@dataclass(frozen=True, slots=True)
class CPUSpec:
    """Slots of the primary (CPU) tier, in key order."""

    slot_ids: IntArray

    medium = Medium.CPU

    @classmethod
    def of(cls, slot_ids: object) -> CPUSpec:
        return cls(_as_ids(slot_ids))

    def __len__(self) -> int:
        return len(self.slot_ids)


@dataclass(frozen=True, slots=True)
class GPUSpec:
    """GPU blocks of one transfer.

    ``block_ids`` lists GPU block ids of every group back to back; ``group_sizes[g]`` is how
    many of them belong to group ``g``; ``block_indices[g]`` is the index, within the first
    offloaded block of group ``g``, of its first GPU block (an offloaded block spans
    ``block_size_factor`` GPU blocks and the first one may start unaligned).
    """

    block_ids: IntArray
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]

    medium = Medium.GPU

    @classmethod
    def of(
        cls,
        block_ids: object,
        group_sizes: Sequence[int] | None = None,
        block_indices: Sequence[int] | None = None,
    ) -> GPUSpec:
        ids = _as_ids(block_ids)
        sizes = (len(ids),) if group_sizes is None else tuple(map(int, group_sizes))
        starts = (0,) * len(sizes) if block_indices is None else tuple(map(int, block_indices))
        if sum(sizes) != len(ids):
            raise ValueError(f"group_sizes sum to {sum(sizes)} but there are {len(ids)} block_ids")
        if len(starts) != len(sizes):
            raise ValueError(f"block_indices has {len(starts)} entries, group_sizes {len(sizes)}")
        return cls(ids, sizes, starts)


@dataclass(frozen=True, slots=True)
class TierSpec:
    """A secondary-tier job: ``keys[i]`` moves to or from primary slot ``slot_ids[i]``."""

    keys: tuple[bytes, ...]
    slot_ids: IntArray

    medium = Medium.STORAGE

    @classmethod
    def of(cls, keys: Iterable[bytes], slot_ids: object) -> TierSpec:
        spec = cls(tuple(keys), _as_ids(slot_ids))
        if len(spec.keys) != len(spec.slot_ids):
            raise ValueError(f"{len(spec.keys)} keys but {len(spec.slot_ids)} slot_ids")
        return spec


@dataclass(slots=True)
class PrepareStoreOutput:
    """What `PrimaryLedger.prepare_store` decided: keys to write into ``store_spec``'s
    slots, in order, and the keys it evicted to make room."""

    keys_to_store: list[bytes]
    store_spec: CPUSpec
    evicted_keys: list[bytes]


@dataclass(slots=True)
class OffloadingEvent:
    """Keys that became readable (``removed=False``) or left (``removed=True``) a medium.

    ``metadata_only``: a removal of keys that were never announced (their write failed);
    it releases bookkeeping and is not a public eviction (vLLM publishes no BlockRemoved).
    ``cleared``: the removal of every key by a reset (announced as ``AllBlocksCleared``).
    """

    keys: list[bytes]
    medium: Medium
    removed: bool
    tier: str | None = field(default=None)
    metadata_only: bool = False
    cleared: bool = False
