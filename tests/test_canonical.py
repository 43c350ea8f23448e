"""Canonical KV views over tensors allocated the way vLLM 0.33 allocates them.

`allocate` mirrors ``compute_layout_strides`` + ``create_kv_cache_views``: one flat int8
buffer, a 5-D ``[L, B, H, N, C]`` strided view in the layout's physical order, and one
``[B, H, N, C]`` view per layer. Every (layer, block, head, token, channel) gets a distinct
value, so a byte out of place shows. The ``vllm``-marked test checks `allocate` against
vLLM's own functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from kvtier_async.ledger import CPUSpec, GPUSpec
from kvtier_async.transfer import (
    CanonicalLayoutError,
    HostCopyHandler,
    HostSlots,
    canonicalize,
)

# vllm/v1/kv_cache_layout.py: the stride permutation of the logical [L, B, H, N, C] axes.
LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
L, B, H, N, C = 3, 5, 2, 4, 6  # layers, blocks, KV heads, tokens per block, K|V elements
DTYPE = torch.int32


def physical_strides(order: Sequence[int], shape: Sequence[int]) -> list[int]:
    """Strides of the logical axes when memory is laid out in ``order`` (outermost first)."""
    strides = [0] * len(shape)
    current = 1
    for dim in reversed(order):
        strides[dim] = current
        current *= shape[dim]
    return strides


def allocate(
    layout: str, shape: Sequence[int] = (L, B, H, N, C), dtype: torch.dtype = DTYPE
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A vLLM-style allocation: the raw int8 buffer and one [B, H, N, C] view per layer."""
    elem = torch.empty(0, dtype=dtype).element_size()
    num_layers, blocks, heads, tokens, content = shape
    shape_bytes = (num_layers, blocks, heads, tokens, content * elem)
    strides = physical_strides(LAYOUTS[layout], shape_bytes)
    raw = torch.zeros(int(np.prod(shape_bytes)), dtype=torch.int8)
    view_5d = torch.as_strided(raw, shape_bytes, strides)
    return raw, [view_5d[layer].view(dtype) for layer in range(num_layers)]


def fill(views: Sequence[torch.Tensor]) -> torch.Tensor:
    """Write a distinct value at every (layer, block, head, token, channel); return them."""
    values = torch.arange(len(views) * views[0].numel(), dtype=DTYPE)
    values = values.reshape(len(views), *views[0].shape)
    for layer, view in enumerate(views):
        view.copy_(values[layer])
    return values


def physical_bytes(values: torch.Tensor, dims: Sequence[int], order: Sequence[int]) -> bytes:
    """``values`` (logical axes ``dims``) laid out in ``order``, as bytes."""
    physical = [d for d in order if d in dims]
    return values.permute([list(dims).index(d) for d in physical]).contiguous().numpy().tobytes()


def layer_page(values: torch.Tensor, layout: str, layer: int, block: int) -> bytes:
    """The bytes of one layer's page of ``block`` in the layout's physical order."""
    return physical_bytes(values[layer, block], (2, 3, 4), LAYOUTS[layout])


def block_row(values: torch.Tensor, layout: str, block: int) -> bytes:
    """Every layer's bytes of ``block`` in the layout's physical order (B outermost)."""
    return physical_bytes(values[:, block], (0, 2, 3, 4), LAYOUTS[layout])


def as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().numpy().tobytes()


def layer_names(count: int = L) -> list[str]:
    return [f"layers.{i}" for i in range(count)]


# -- the six layouts ---------------------------------------------------------------

PAGE = H * N * C * 4


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_layer_outermost_contiguous_pages(layout: str) -> None:
    raw, views = allocate(layout)
    values = fill(views)
    kv = canonicalize(dict(zip(layer_names(), views, strict=True)))
    assert len(kv.views) == L
    assert kv.groups == ((0, 1, 2),)
    for layer, view in enumerate(kv.views):
        assert view.is_contiguous_page
        assert (view.page_size, view.block_stride, view.num_blocks) == (PAGE, PAGE, B)
        assert view.tensor.shape == (B, PAGE)
        assert view.tensor.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
        for block in range(B):
            assert as_bytes(view.page(block)) == layer_page(values, layout, layer, block)


def test_lhbnc_pages_are_strided_runs() -> None:
    raw, views = allocate("LHBNC")
    values = fill(views)
    kv = canonicalize(dict(zip(layer_names(), views, strict=True)))
    assert len(kv.views) == L
    run = N * C * 4
    for layer, view in enumerate(kv.views):
        assert [(r.offset, r.size) for r in view.runs] == [(h * B * run, run) for h in range(H)]
        assert view.block_stride == run
        assert view.page_size == PAGE
        assert view.address == raw.data_ptr() + layer * B * PAGE
        for block in range(B):
            assert as_bytes(view.page(block)) == layer_page(values, "LHBNC", layer, block)


@pytest.mark.parametrize("layout", ["BLHNC", "BLNHC", "BHLNC"])
def test_block_outermost_gives_one_cross_layer_row(layout: str) -> None:
    raw, views = allocate(layout)
    values = fill(views)
    kv = canonicalize(dict(zip(layer_names(), views, strict=True)))
    (view,) = kv.views
    assert kv.groups == ((0,),)
    assert view.is_contiguous_page
    assert (view.page_size, view.block_stride) == (L * PAGE, L * PAGE)
    assert view.address == raw.data_ptr()
    assert "cross-layer" in view.name
    for block in range(B):
        assert as_bytes(view.page(block)) == block_row(values, layout, block)


@pytest.mark.parametrize(
    ("layout", "runs"),
    [("BLHNC", [(0, PAGE)]), ("BLNHC", [(0, PAGE)]), ("BHLNC", None)],
)
def test_block_outermost_per_layer_when_layers_are_not_adjacent(
    layout: str, runs: list[tuple[int, int]] | None
) -> None:
    """Layers 0 and 2 alone do not fill one interval of a block: per-layer views."""
    _, views = allocate(layout)
    values = fill(views)
    kv = canonicalize({"a": views[0], "c": views[2]})
    assert [view.name for view in kv.views] == ["a", "c"]
    for layer, view in zip((0, 2), kv.views, strict=True):
        assert view.block_stride == L * PAGE
        if runs is not None:
            assert [(r.offset, r.size) for r in view.runs] == runs
        if layout == "BHLNC":  # H runs of N*C, a head's worth of all layers apart
            assert [(r.offset, r.size) for r in view.runs] == [
                (h * L * N * C * 4, N * C * 4) for h in range(H)
            ]
        for block in range(B):
            assert as_bytes(view.page(block)) == layer_page(values, layout, layer, block)


def test_two_groups_in_one_block_outermost_allocation() -> None:
    _, views = allocate("BLHNC", shape=(4, B, H, N, C))
    values = fill(views)
    names = layer_names(4)
    kv = canonicalize(dict(zip(names, views, strict=True)), groups=[names[:2], names[2:]])
    assert kv.groups == ((0,), (1,))
    first, second = kv.views
    assert first.page_size == second.page_size == 2 * PAGE
    assert second.address == first.address + 2 * PAGE
    for block in range(B):
        row = physical_bytes(values[:, block], (0, 2, 3, 4), LAYOUTS["BLHNC"])
        assert as_bytes(first.page(block)) + as_bytes(second.page(block)) == row


def test_groups_sharing_layers_share_views() -> None:
    _, views = allocate("LBNHC")
    kv = canonicalize(
        dict(zip(layer_names(), views, strict=True)),
        groups=[["layers.0", "layers.1"], ["layers.1", "layers.2"]],
    )
    assert kv.groups == ((0, 1), (1, 2))
    layout = kv.slot_layout(2)
    assert layout.slot_bytes == 2 * 3 * PAGE
    assert layout.offsets == (0, 2 * PAGE, 4 * PAGE)


# -- MLA and split K/V -------------------------------------------------------------


def test_mla_latent_cache() -> None:
    """One latent vector per token, no V: [B, N, C] views of one layer-major allocation."""
    latent = 9
    raw = torch.zeros(L * B * N * latent, dtype=torch.int16)
    views = [raw.view(L, B, N, latent)[layer] for layer in range(L)]
    for layer, view in enumerate(views):
        view.copy_(torch.arange(view.numel(), dtype=torch.int16).reshape(view.shape) + layer)
    kv = canonicalize(dict(zip(layer_names(), views, strict=True)))
    for layer, canonical in enumerate(kv.views):
        assert canonical.is_contiguous_page
        assert canonical.page_size == N * latent * 2
        for block in range(B):
            assert as_bytes(canonical.page(block)) == as_bytes(views[layer][block])


def test_split_k_and_v() -> None:
    """(2, num_blocks, N, H, D) per layer gives a [K] and a [V] view, each one run."""
    tensors = {name: torch.randn(2, B, N, H, 8) for name in layer_names(2)}
    kv = canonicalize(tensors, num_blocks=B)
    assert [view.name for view in kv.views] == [
        "layers.0[K]",
        "layers.0[V]",
        "layers.1[K]",
        "layers.1[V]",
    ]
    for index, view in enumerate(kv.views):
        source = tensors[f"layers.{index // 2}"][index % 2]
        assert view.page_size == N * H * 8 * 4
        assert view.tensor.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
        for block in range(B):
            assert as_bytes(view.page(block)) == as_bytes(source[block])


def test_split_k_and_v_inferred_without_num_blocks() -> None:
    kv = canonicalize({"x": torch.zeros(2, 7, 4, 2, 8)})
    assert [view.num_blocks for view in kv.views] == [7, 7]


def test_views_are_zero_copy() -> None:
    _, views = allocate("LBNHC")
    kv = canonicalize(dict(zip(layer_names(), views, strict=True)))
    kv.views[1].tensor[2].fill_(7)
    assert bool((views[1][2].view(torch.int8) == 7).all())
    assert int(views[1][1].view(torch.int8).abs().sum()) == 0


def test_padded_pages() -> None:
    """vLLM's page_size_padded: pages one run, block stride larger than the page."""
    pad = 64
    raw = torch.zeros(L * B * (PAGE + pad), dtype=torch.int8)
    views = [
        torch.as_strided(
            raw, (B, H, N, C * 4), (PAGE + pad, N * C * 4, C * 4, 1), layer * B * (PAGE + pad)
        ).view(DTYPE)
        for layer in range(L)
    ]
    kv = canonicalize(dict(zip(layer_names(), views, strict=True)))
    assert [(v.page_size, v.block_stride) for v in kv.views] == [(PAGE, PAGE + pad)] * L


# -- the slot layout: bytes land where the docstring says ----------------------------


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("factor", [1, 2, 3])
def test_slot_bytes_follow_the_layout(layout: str, factor: int) -> None:
    _, views = allocate(layout)
    values = fill(views)
    kv = canonicalize(dict(zip(layer_names(), views, strict=True)))
    slot_layout = kv.slot_layout(factor)
    assert slot_layout.slot_bytes == factor * L * PAGE
    slots = torch.zeros(4, slot_layout.slot_bytes, dtype=torch.uint8)
    host = HostSlots.from_tensor(slots)
    handler = HostCopyHandler(kv, host, block_size_factor=factor, to_host=True)
    blocks = [4, 1, 3]
    first = factor - 1  # unaligned first block (position factor-1 of the first slot)
    slot_ids = [2, 0, 3][: -(-(first + len(blocks)) // factor)]
    handler.execute(GPUSpec.of(blocks, block_indices=[first]), CPUSpec.of(slot_ids))
    for i, block in enumerate(blocks):
        slot, position = slot_ids[(first + i) // factor], (first + i) % factor
        row = as_bytes(slots[slot])
        if len(kv.views) == 1:  # one cross-layer row per GPU block
            start = position * L * PAGE
            assert row[start : start + L * PAGE] == block_row(values, layout, block)
        else:
            for layer in range(L):
                start = slot_layout.page_offset(layer, position)
                assert row[start : start + PAGE] == layer_page(values, layout, layer, block)


# -- unsupported tensors -----------------------------------------------------------


def test_error_names_shape_and_strides_for_non_contiguous_content() -> None:
    bad = torch.zeros(B, H, N, 2 * C)[..., ::2]  # every other channel
    with pytest.raises(
        CanonicalLayoutError, match=r"shape \(5, 2, 4, 6\), strides \(96, 48, 12, 2\).*innermost"
    ):
        canonicalize({"bad": bad})


def test_transposed_page_is_still_one_run() -> None:
    """Pages are bytes: a permuted but dense block is one run, whatever its logical order."""
    source = torch.arange(B * H * C * N, dtype=DTYPE).reshape(B, H, C, N)
    kv = canonicalize({"x": source.transpose(-1, -2)})
    assert kv.views[0].is_contiguous_page
    assert as_bytes(kv.views[0].page(3)) == as_bytes(source[3])


def test_error_for_broadcast_pages() -> None:
    with pytest.raises(CanonicalLayoutError, match="broadcast"):
        canonicalize({"bad": torch.zeros(1, H, N, C).expand(B, H, N, C)})


def test_error_for_wrong_block_count() -> None:
    with pytest.raises(CanonicalLayoutError, match=r"shape \(5, 2, 4, 6\).*expected 9 blocks"):
        canonicalize({"x": torch.zeros(B, H, N, C)}, num_blocks=9)


def test_error_for_missing_layer() -> None:
    with pytest.raises(ValueError, match="'nope'"):
        canonicalize({"x": torch.zeros(B, H, N, C)}, groups=[["x", "nope"]])


def test_error_for_overlapping_blocks() -> None:
    base = torch.zeros(100, dtype=torch.int8)
    overlapping = torch.as_strided(base, (B, 16), (8, 1))
    with pytest.raises(CanonicalLayoutError, match="overlap"):
        canonicalize({"x": overlapping})


# -- against vLLM's own allocation -------------------------------------------------


@pytest.mark.vllm
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_matches_vllm_allocation(layout: str) -> None:
    interface = pytest.importorskip("vllm.v1.kv_cache_interface")
    from vllm.v1.kv_cache_layout import KVCacheLayout

    assert KVCacheLayout[layout].value == LAYOUTS[layout]
    spec = interface.FullAttentionSpec(
        block_size=N, num_kv_heads=H, head_size=C // 2, dtype=torch.float32
    )
    vllm_layout = KVCacheLayout[layout]
    layer_stride, block_stride, *_ = interface.compute_layout_strides(spec, B, L, vllm_layout)
    tensor = interface.KVCacheTensor(
        size=L * B * PAGE,
        layers=layer_names(),
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    raw = torch.zeros(L * B * PAGE, dtype=torch.int8)
    theirs = interface.create_kv_cache_views(raw, spec, B, vllm_layout, tensor)
    _, ours = allocate(layout)
    for mine, vllm_view in zip(ours, theirs, strict=True):
        assert vllm_view.shape == mine.shape
        assert vllm_view.stride() == mine.stride()
    values = fill([view.view(DTYPE) for view in theirs])
    kv = canonicalize(dict(zip(layer_names(), theirs, strict=True)))
    for block in range(B):
        if LAYOUTS[layout][0] == 1:
            assert as_bytes(kv.views[0].page(block)) == block_row(values, layout, block)
        else:
            for layer, view in enumerate(kv.views):
                assert as_bytes(view.page(block)) == layer_page(values, layout, layer, block)
