"""Canonical KV views: every backend's KV cache as byte pages, one page per block.

Theory of operation
-------------------
vLLM 0.33 describes each KV-cache group by a logical shape ``[L, B, H, N, C]`` (layers,
blocks, KV heads, tokens in a block, K|V content) stored in one of six physical orders
(``vllm/v1/kv_cache_layout.py``): LBHNC, LBNHC (FlashAttention's), LHBNC, BLHNC, BLNHC and
BHLNC. ``register_kv_caches`` hands the worker one view per layer, ``[B, H, N, C]`` with K
and V packed in the last dimension, all over one shared allocation. Older backends hand
split K/V tensors ``(2, B, ...)``, and MLA caches hold one latent vector per token
(``[B, N, C]``, no V).

`canonicalize` turns those views into `CanonicalView` objects: int8 views of the *same*
memory (zero-copy, checked) whose first dimension is the block. Nothing is assumed about
the layout; it is read off data pointers and strides:

* The dimensions of a view other than the block one are sorted by stride and merged where
  they are contiguous. What is left is a *run* (the innermost contiguous bytes) repeated at
  fixed offsets: the page of block ``b`` is ``runs`` at ``address + b * block_stride``.
* Views of one allocation whose pages sit side by side inside each block (``B`` outermost:
  BLHNC, BLNHC, BHLNC) and that belong to the same KV-cache groups are merged into one
  *cross-layer* view: one contiguous row per block holding every layer's page.

What the six layouts become (per-layer view ``[B, H, N, C]``, ``P = H * N * C`` bytes):

=======  ============================================================================
LBHNC    per layer: one run of ``P`` bytes, ``block_stride = P`` (pages back to back)
LBNHC    per layer: one run of ``P`` bytes, ``block_stride = P``
LHBNC    per layer: ``H`` runs of ``N * C`` bytes, ``B * N * C`` apart
BLHNC    cross-layer: one run of ``L * P`` bytes per block ([L, H, N, C] order)
BLNHC    cross-layer: one run of ``L * P`` bytes per block ([L, N, H, C] order)
BHLNC    cross-layer: one run of ``L * P`` bytes per block ([H, L, N, C] order)
=======  ============================================================================

When the layers of a group do not fill one interval of each block (only some layers are
given, or another group's layers sit between them), B-outermost layouts stay per layer:
BLHNC and BLNHC one run of ``P`` bytes ``L * P`` apart, BHLNC ``H`` runs of ``N * C``.
vLLM lets KV-cache groups overlay the same bytes (a block belongs to one group at a
time); identical views are shared, so such groups point at the same canonical view.

An MLA view is one run per block; a split K/V tensor gives two views, ``[K]`` then ``[V]``.
Anything else that is a strided byte pattern works the same way; what does not (a
non-contiguous innermost dimension, overlapping or broadcast pages, pages outside their
storage) raises `CanonicalLayoutError` naming the shape and strides.

The *page* of a view is its block's bytes in address order, the runs concatenated:
``view.page(b) == view.tensor[b].reshape(-1)``. CPU copies therefore keep the backend's
physical order (as vLLM's canonical pages keep the layout family, ``canonical_format_id``):
bytes stored under one layout are only meaningful to a worker with the same layout.

Slot layout
-----------
An offloaded block spans ``F = block_size_factor`` consecutive GPU blocks of one KV-cache
group and lives in one CPU slot. A slot holds one section per canonical view, in
`CanonicalKV.views` order, each ``F`` pages long::

    slot  = | view 0: page(g_0) ... page(g_F-1) | view 1: page(g_0) ... | ... | view V-1 |
    offset(v)  = F * sum(page_size[u] for u < v)
    slot_bytes = F * sum(page_size[v] for v in views)

``g_i`` is the i-th GPU block of the offloaded block. A key of group ``g`` uses only the
sections of group ``g``'s views (``CanonicalKV.groups[g]``); the other sections of its slot
are left alone (vLLM likewise reserves every tensor's page in every slot). When a group's
first GPU block is unaligned (``GPUSpec.block_indices[g] = k``), its first ``k % F`` pages
in the first slot are skipped: not written by a store, not read by a load; a group's last
slot may be partly filled the same way. `SlotLayout` computes the offsets.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch

__all__ = [
    "ByteRun",
    "CanonicalKV",
    "CanonicalLayoutError",
    "CanonicalView",
    "SlotLayout",
    "canonicalize",
]

IntArray = npt.NDArray[np.int64]

# A page split into more runs than this is almost certainly a layout we misread; refuse it.
MAX_RUNS_PER_PAGE: Final = 4096


class CanonicalLayoutError(ValueError):
    """A KV-cache tensor cannot be viewed as byte pages (the message names its shape and
    strides)."""


@dataclass(frozen=True, slots=True)
class ByteRun:
    """``size`` contiguous bytes at ``offset`` from a block's address."""

    offset: int
    size: int


@dataclass(frozen=True, eq=False)
class CanonicalView:
    """Byte pages of one KV-cache tensor (or of several layers sharing each block).

    ``tensor`` is an int8 view of the source memory: ``(num_blocks, page_size)`` when a page
    is one run, else ``(num_blocks, *outer, run_size)``. Block ``b``'s page is the ``runs``
    at ``address + b * block_stride``, concatenated in address order.
    """

    name: str
    tensor: torch.Tensor
    block_stride: int
    runs: tuple[ByteRun, ...]
    run_offsets: IntArray = field(repr=False)
    run_sizes: IntArray = field(repr=False)

    @property
    def num_blocks(self) -> int:
        return int(self.tensor.shape[0])

    @property
    def page_size(self) -> int:
        return sum(run.size for run in self.runs)

    @property
    def address(self) -> int:
        """Address of block 0's first byte."""
        return int(self.tensor.data_ptr())

    @property
    def is_contiguous_page(self) -> bool:
        return len(self.runs) == 1

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def page(self, block: int) -> torch.Tensor:
        """Block ``block``'s page as a 1-D int8 tensor (a view when the page is one run)."""
        return self.tensor[block].reshape(-1)

    def block_addresses(self, blocks: IntArray) -> IntArray:
        """Addresses of the pages of ``blocks`` (no bounds check)."""
        return self.address + blocks * self.block_stride


@dataclass(frozen=True)
class SlotLayout:
    """Where each view's pages sit in a CPU slot (see the module docstring)."""

    factor: int
    page_sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    slot_bytes: int

    def page_offset(self, view: int, position: int) -> int:
        """Byte offset in a slot of page ``position`` (``0 <= position < factor``) of
        ``view``."""
        if not 0 <= position < self.factor:
            raise IndexError(f"page position {position} out of range [0, {self.factor})")
        return self.offsets[view] + position * self.page_sizes[view]


@dataclass(frozen=True, eq=False)
class CanonicalKV:
    """The canonical views of a worker's KV caches and which views each group uses."""

    views: tuple[CanonicalView, ...]
    groups: tuple[tuple[int, ...], ...]

    @property
    def device(self) -> torch.device:
        return self.views[0].device

    @property
    def page_sizes(self) -> tuple[int, ...]:
        return tuple(view.page_size for view in self.views)

    def slot_layout(self, block_size_factor: int = 1) -> SlotLayout:
        """The slot layout for offloaded blocks of ``block_size_factor`` GPU blocks."""
        factor = operator.index(block_size_factor)
        if factor < 1:
            raise ValueError(f"block_size_factor must be >= 1, got {block_size_factor}")
        sizes = self.page_sizes
        offsets = tuple(int(x) for x in np.cumsum((0, *sizes[:-1])) * factor)
        return SlotLayout(factor, sizes, offsets, factor * sum(sizes))

    def describe(self) -> str:
        """One line per view: name, page size, runs, block stride, groups."""
        lines = []
        for index, view in enumerate(self.views):
            groups = [g for g, members in enumerate(self.groups) if index in members]
            lines.append(
                f"[{index}] {view.name}: page {view.page_size} B in {len(view.runs)} run(s), "
                f"block stride {view.block_stride} B, {view.num_blocks} blocks, groups {groups}"
            )
        return "\n".join(lines)


def canonicalize(
    kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
    groups: Sequence[Sequence[str]] | None = None,
    *,
    num_blocks: int | None = None,
) -> CanonicalKV:
    """Canonical views of ``kv_caches`` (layer name -> tensor, as ``register_kv_caches`` gets).

    Args:
        kv_caches: Per layer, a tensor whose first dimension is the block (``[B, H, N, C]``,
            MLA ``[B, N, C]``), a split K/V tensor ``(2, B, ...)``, or a list of such tensors.
        groups: Layer names of each KV-cache group, in order; default: one group of every
            layer in ``kv_caches`` order. Layers in no group are ignored.
        num_blocks: Blocks per layer (vLLM's ``kv_cache_config.num_blocks``). Inferred when
            omitted; pass it when a split K/V tensor could be read either way.

    Raises:
        CanonicalLayoutError: A tensor's memory is not a pattern of byte pages per block.
        ValueError: A group names a layer that ``kv_caches`` lacks, or devices differ.
    """
    group_names = [list(kv_caches)] if groups is None else [list(g) for g in groups]
    if not group_names or not any(group_names):
        raise ValueError("no KV-cache layers to canonicalize")
    membership = _membership(kv_caches, group_names)
    tensors = {name: _as_list(kv_caches[name]) for name in membership}
    blocks = num_blocks if num_blocks is not None else _infer_num_blocks(tensors)
    layer_geoms: dict[str, list[_Geometry]] = {}
    for layer, parts in tensors.items():
        layer_geoms[layer] = [
            _geometry(part_name, part, membership[layer])
            for part_name, part in _block_tensors(layer, parts, blocks)
        ]
    all_geoms = [geom for geoms in layer_geoms.values() for geom in geoms]
    _check_devices(all_geoms)
    replaced = _merge_cross_layer(all_geoms)
    views: list[CanonicalView] = []
    index_of: dict[tuple[object, ...], int] = {}
    geom_index: dict[int, int] = {}
    for geom in all_geoms:
        final = replaced.get(id(geom), geom)
        key = final.key()
        if key not in index_of:
            index_of[key] = len(views)
            views.append(_make_view(final))
        geom_index[id(geom)] = index_of[key]
    group_views = tuple(
        tuple(dict.fromkeys(geom_index[id(geom)] for layer in names for geom in layer_geoms[layer]))
        for names in group_names
    )
    return CanonicalKV(tuple(views), group_views)


# -- geometry of one block tensor --------------------------------------------------


@dataclass(eq=False)
class _Geometry:
    name: str
    tensor: torch.Tensor  # the source tensor, block dimension first
    storage_ptr: int
    storage_nbytes: int
    address: int
    block_stride: int
    num_blocks: int
    outer: list[tuple[int, int]]  # (size, byte stride) of the non-run dims, outermost first
    run: int  # bytes of one run
    offsets: list[int]  # run offsets from the block's address, increasing
    groups: tuple[int, ...]

    @property
    def extent(self) -> int:
        return self.offsets[-1] + self.run

    def key(self) -> tuple[object, ...]:
        return (
            self.storage_ptr,
            self.address,
            self.block_stride,
            self.num_blocks,
            self.run,
            tuple(self.offsets),
        )

    def describe(self) -> str:
        return _describe(self.name, self.tensor)


def _describe(name: str, tensor: torch.Tensor) -> str:
    return (
        f"{name}: shape {tuple(tensor.shape)}, strides {tuple(tensor.stride())}, "
        f"dtype {tensor.dtype}, storage offset {tensor.storage_offset()}"
    )


def _geometry(name: str, tensor: torch.Tensor, groups: tuple[int, ...]) -> _Geometry:
    """Read the page pattern of a tensor whose first dimension is the block."""
    if tensor.dim() < 2:
        raise CanonicalLayoutError(
            f"{_describe(name, tensor)}: expected a block dimension and at least one more"
        )
    elem = tensor.element_size()
    num_blocks = int(tensor.shape[0])
    dims = [
        (int(size), int(stride) * elem)
        for size, stride in zip(tensor.shape[1:], tensor.stride()[1:], strict=True)
        if size != 1
    ]
    if any(stride <= 0 for _, stride in dims):
        raise CanonicalLayoutError(f"{_describe(name, tensor)}: broadcast (stride 0) dimension")
    dims.sort(key=lambda dim: dim[1], reverse=True)
    merged: list[tuple[int, int]] = []  # innermost first while building
    for size, stride in reversed(dims):
        if merged and stride == merged[-1][0] * merged[-1][1]:
            merged[-1] = (merged[-1][0] * size, merged[-1][1])
        else:
            merged.append((size, stride))
    merged.reverse()
    if not merged:
        merged = [(1, elem)]
    if merged[-1][1] != elem:
        raise CanonicalLayoutError(
            f"{_describe(name, tensor)}: the innermost dimension is not contiguous, so a "
            "page has no contiguous byte run"
        )
    run = merged[-1][0] * elem
    outer = merged[:-1]
    count = int(np.prod([size for size, _ in outer], dtype=np.int64))
    if count > MAX_RUNS_PER_PAGE:
        raise CanonicalLayoutError(
            f"{_describe(name, tensor)}: a page would be {count} runs of {run} bytes "
            f"(more than {MAX_RUNS_PER_PAGE})"
        )
    offsets = [0]
    for size, stride in outer:
        offsets = [base + i * stride for base in offsets for i in range(size)]
    offsets.sort()
    if any(b < a + run for a, b in itertools.pairwise(offsets)):
        raise CanonicalLayoutError(f"{_describe(name, tensor)}: the runs of a page overlap")
    extent = offsets[-1] + run
    block_stride = int(tensor.stride(0)) * elem if num_blocks > 1 else max(extent, 1)
    if block_stride <= 0:
        raise CanonicalLayoutError(f"{_describe(name, tensor)}: broadcast block dimension")
    storage = tensor.untyped_storage()
    geom = _Geometry(
        name=name,
        tensor=tensor,
        storage_ptr=int(storage.data_ptr()),
        storage_nbytes=int(storage.nbytes()),
        address=int(tensor.data_ptr()),
        block_stride=block_stride,
        num_blocks=num_blocks,
        outer=outer,
        run=run,
        offsets=offsets,
        groups=groups,
    )
    _check_blocks_disjoint(geom)
    _check_in_storage(geom)
    return geom


def _check_blocks_disjoint(geom: _Geometry) -> None:
    """Pages of different blocks must not share bytes.

    Either a page fits within one block stride (the usual case), or the blocks interleave
    LHBNC-style: every run stays inside one stride-sized cell and the runs' cells are at
    least ``num_blocks`` cells apart, so block ``b`` fills cell ``c + b`` of each run.
    """
    stride, run = geom.block_stride, geom.run
    if geom.num_blocks == 1 or geom.extent <= stride:
        return
    cells = [offset // stride for offset in geom.offsets]
    inside = all(offset % stride + run <= stride for offset in geom.offsets)
    apart = all(b - a >= geom.num_blocks for a, b in itertools.pairwise(cells))
    if not (inside and apart):
        raise CanonicalLayoutError(
            f"{geom.describe()}: pages of different blocks would overlap (block stride "
            f"{stride} B, page extent {geom.extent} B)"
        )


def _check_in_storage(geom: _Geometry) -> None:
    start = geom.address - geom.storage_ptr
    end = start + (geom.num_blocks - 1) * geom.block_stride + geom.extent
    if start < 0 or end > geom.storage_nbytes:
        raise CanonicalLayoutError(
            f"{geom.describe()}: pages span bytes [{start}, {end}) of a "
            f"{geom.storage_nbytes}-byte storage"
        )


# -- cross-layer merging -----------------------------------------------------------


def _merge_cross_layer(geoms: list[_Geometry]) -> dict[int, _Geometry]:
    """Merge views whose pages fill one contiguous interval of each block.

    Candidates share storage, block stride, block count, device and group membership, and
    each page fits within one block stride. Returns ``id(geometry) -> merged geometry``.
    """
    buckets: dict[tuple[object, ...], list[_Geometry]] = {}
    for geom in geoms:
        if geom.extent <= geom.block_stride and geom.num_blocks > 1:
            key = (
                geom.storage_ptr,
                geom.block_stride,
                geom.num_blocks,
                str(geom.tensor.device),
                geom.groups,
            )
            buckets.setdefault(key, []).append(geom)
    replaced: dict[int, _Geometry] = {}
    for members in buckets.values():
        unique = list({member.key(): member for member in members}.values())
        if len(unique) < 2:
            continue
        merged = _merged(unique)
        if merged is not None:
            for member in members:
                replaced[id(member)] = merged
    return replaced


def _merged(members: list[_Geometry]) -> _Geometry | None:
    """One geometry covering ``members`` if their pages tile one interval of a block."""
    members = sorted(members, key=lambda g: g.address)
    low = members[0].address
    intervals = sorted(
        (geom.address - low + offset, geom.address - low + offset + geom.run)
        for geom in members
        for offset in geom.offsets
    )
    end = intervals[0][1]
    for start, stop in intervals[1:]:
        if start != end:
            return None  # a gap (another group's bytes, padding) or an overlap
        end = stop
    if end > members[0].block_stride:
        return None
    first = members[0]
    names = [geom.name for geom in members]
    return _Geometry(
        name=f"{names[0]}..{names[-1]} ({len(names)} views, cross-layer)",
        tensor=first.tensor,
        storage_ptr=first.storage_ptr,
        storage_nbytes=first.storage_nbytes,
        address=low,
        block_stride=first.block_stride,
        num_blocks=first.num_blocks,
        outer=[],
        run=end,
        offsets=[0],
        groups=first.groups,
    )


# -- building views ----------------------------------------------------------------


def _make_view(geom: _Geometry) -> CanonicalView:
    import torch

    source = geom.tensor
    size = (geom.num_blocks, *(s for s, _ in geom.outer), geom.run)
    stride = (geom.block_stride, *(st for _, st in geom.outer), 1)
    view = torch.empty(0, dtype=torch.int8, device=source.device).set_(
        source.untyped_storage(), geom.address - geom.storage_ptr, size, stride
    )
    if view.data_ptr() != geom.address or view.untyped_storage().data_ptr() != geom.storage_ptr:
        raise CanonicalLayoutError(f"{geom.describe()}: the int8 view is not zero-copy")
    runs = tuple(ByteRun(offset, geom.run) for offset in geom.offsets)
    return CanonicalView(
        name=geom.name,
        tensor=view,
        block_stride=geom.block_stride,
        runs=runs,
        run_offsets=np.asarray(geom.offsets, dtype=np.int64),
        run_sizes=np.full(len(runs), geom.run, dtype=np.int64),
    )


def _membership(
    kv_caches: Mapping[str, object], group_names: list[list[str]]
) -> dict[str, tuple[int, ...]]:
    """Layer -> the groups it belongs to, in first-appearance order."""
    membership: dict[str, list[int]] = {}
    for g, names in enumerate(group_names):
        for name in names:
            if name not in kv_caches:
                raise ValueError(f"group {g} names layer {name!r}, which kv_caches lacks")
            groups = membership.setdefault(name, [])
            if g not in groups:
                groups.append(g)
    return {name: tuple(groups) for name, groups in membership.items()}


def _as_list(value: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    return list(value)


def _infer_num_blocks(tensors: Mapping[str, list[torch.Tensor]]) -> int:
    """Blocks per layer: dim 0 of a tensor whose dim 0 is not 2, else dim 1 of a 5-D one."""
    parts = [part for items in tensors.values() for part in items]
    firsts = {int(part.shape[0]) for part in parts if part.dim() > 0 and part.shape[0] != 2}
    if len(firsts) == 1:
        return firsts.pop()
    if firsts:
        raise CanonicalLayoutError(
            f"tensors disagree on the number of blocks (dim 0 in {sorted(firsts)}); pass num_blocks"
        )
    split = {int(part.shape[1]) for part in parts if part.dim() == 5}
    return split.pop() if len(split) == 1 else 2


def _block_tensors(
    layer: str, parts: list[torch.Tensor], num_blocks: int
) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a layer with the block dimension first, named for error messages."""
    out: list[tuple[str, torch.Tensor]] = []
    for index, part in enumerate(parts):
        name = layer if len(parts) == 1 else f"{layer}[{index}]"
        blocks_first = part.dim() >= 2 and part.shape[0] == num_blocks
        split = part.dim() >= 3 and part.shape[0] == 2 and part.shape[1] == num_blocks
        if blocks_first and split:
            raise CanonicalLayoutError(
                f"{_describe(name, part)}: ambiguous with {num_blocks} blocks (blocks first "
                "or split K/V?)"
            )
        if blocks_first:
            out.append((name, part))
        elif split:
            out.extend(((f"{name}[K]", part[0]), (f"{name}[V]", part[1])))
        else:
            raise CanonicalLayoutError(
                f"{_describe(name, part)}: expected {num_blocks} blocks in dim 0, or a split "
                f"K/V tensor (2, {num_blocks}, ...)"
            )
    return out


def _check_devices(geoms: list[_Geometry]) -> None:
    devices = {str(geom.tensor.device) for geom in geoms}
    if len(devices) > 1:
        raise ValueError(f"KV caches are on several devices: {sorted(devices)}")
