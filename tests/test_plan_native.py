"""The C planner (``kvtier_plan``, `Planner`) against numpy's `plan_transfer(...).merged()`:
the same runs for every layout, block size factor, group split and id pattern, both
directions; the same errors for bad specs; numpy where a layout has strided pages."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from kvtier_async.ledger import CPUSpec, GPUSpec
from kvtier_async.transfer import CanonicalKV, HostSlots, Planner, canonicalize, plan_transfer
from kvtier_async.transfer.plan import native_planning

NUM_BLOCKS = 40
NUM_SLOTS = 48
L, H, N, C = 4, 2, 16, 8  # layers, KV heads, tokens per block, channels (int16)

# vllm/v1/kv_cache_layout.py's stride orders of the logical [L, B, H, N, C] axes
ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),  # pages are strided runs: planned in numpy
    "BLHNC": (1, 0, 2, 3, 4),  # block outermost: one cross-layer row per block
}


def _kv(order: str, *, two_groups: bool) -> CanonicalKV:
    shape = (L, NUM_BLOCKS, H, N, C * 2)  # bytes of int16 channels
    strides = [0] * 5
    step = 1
    for dim in reversed(ORDERS[order]):
        strides[dim] = step
        step *= shape[dim]
    raw = torch.zeros(int(np.prod(shape)), dtype=torch.int8)
    full = torch.as_strided(raw, shape, strides)
    names = [f"layers.{i}" for i in range(L)]
    caches = {name: full[i].view(torch.int16) for i, name in enumerate(names)}
    groups = [names[:2], names[2:]] if two_groups else [names]
    return canonicalize(caches, groups=groups, num_blocks=NUM_BLOCKS)


def _specs(
    rng: np.random.Generator,
    sizes: Sequence[int],
    firsts: Sequence[int],
    factor: int,
    *,
    contiguous: bool,
) -> tuple[GPUSpec, CPUSpec]:
    total = sum(sizes)
    needed = sum(-(-(f % factor + n) // factor) for n, f in zip(sizes, firsts, strict=True) if n)
    if contiguous:
        start = int(rng.integers(0, NUM_BLOCKS - total + 1))
        blocks = np.arange(start, start + total)
        slot0 = int(rng.integers(0, NUM_SLOTS - needed + 1))
        slots = np.arange(slot0, slot0 + needed)
    else:
        blocks = rng.permutation(NUM_BLOCKS)[:total]
        slots = rng.permutation(NUM_SLOTS)[:needed]
    return GPUSpec.of(blocks, sizes, firsts), CPUSpec.of(slots)


def _same(a: object, b: object) -> None:
    for field in ("src", "dst", "size"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field


@pytest.fixture(scope="module")
def native() -> None:
    if not native_planning():
        pytest.skip("no C compiler / KVTIER_NATIVE_COPY=0: plans are made in numpy")


@pytest.mark.parametrize("order", sorted(ORDERS))
@pytest.mark.parametrize("two_groups", [False, True], ids=["one-group", "two-groups"])
@pytest.mark.parametrize("factor", [1, 2, 3])
@pytest.mark.parametrize("to_host", [True, False], ids=["store", "load"])
def test_the_same_runs_as_numpy(
    native: None, order: str, two_groups: bool, factor: int, to_host: bool
) -> None:
    kv = _kv(order, two_groups=two_groups)
    layout = kv.slot_layout(factor)
    slots = torch.zeros(NUM_SLOTS, layout.slot_bytes + 64, dtype=torch.uint8)  # rows padded
    host = HostSlots.from_tensor(slots)
    planner = Planner(kv, layout, host, to_host=to_host)
    assert planner.native == (order != "LHBNC")
    rng = np.random.default_rng([factor, len(order), int(two_groups), int(to_host)])
    groups = len(kv.groups)
    for trial in range(60):
        sizes = [int(n) for n in rng.integers(0, 9, groups)]
        firsts = [int(f) for f in rng.integers(0, 2 * factor, groups)]
        if trial == 0:
            sizes = [1] + [0] * (groups - 1)  # a single block
        if sum(sizes) == 0:
            continue
        gpu, cpu = _specs(rng, sizes, firsts, factor, contiguous=trial % 2 == 0)
        ours = planner(gpu, cpu)
        reference = plan_transfer(kv, layout, host, gpu, cpu, to_host=to_host).merged()
        _same(ours, reference)
        assert ours.joined and ours.merged() is ours
    blocks = plan_transfer(kv, layout, host, gpu, cpu, to_host=to_host)
    assert len(blocks.merged()) <= len(blocks)


@pytest.mark.parametrize(
    ("gpu", "cpu", "message"),
    [
        (GPUSpec.of([NUM_BLOCKS]), CPUSpec.of([0]), "GPU block id .* 40 out of range"),
        (GPUSpec.of([-1]), CPUSpec.of([0]), "GPU block id .* -1 out of range"),
        (GPUSpec.of([0]), CPUSpec.of([NUM_SLOTS]), "CPU slot id 48 out of range"),
        (GPUSpec.of([0]), CPUSpec.of([-3]), "CPU slot id -3 out of range"),
        (GPUSpec.of([0, 1]), CPUSpec.of([0]), "specs do not match"),
        (GPUSpec.of([0]), CPUSpec.of([0, 1]), "specs do not match"),
        (GPUSpec.of([0], [1, 0]), CPUSpec.of([0]), "the GPU spec has 2 groups"),
    ],
)
def test_bad_specs_are_named_as_numpy_names_them(
    native: None, gpu: GPUSpec, cpu: CPUSpec, message: str
) -> None:
    kv = _kv("LBNHC", two_groups=False)
    layout = kv.slot_layout(1)
    host = HostSlots.from_tensor(torch.zeros(NUM_SLOTS, layout.slot_bytes, dtype=torch.uint8))
    with pytest.raises(ValueError, match=message):
        Planner(kv, layout, host, to_host=True)(gpu, cpu)


def test_ids_of_another_dtype_or_stride_are_planned_alike(native: None) -> None:
    """Specs built by hand (int32 ids, a strided view) take numpy's path, to the same runs."""
    kv = _kv("LBHNC", two_groups=False)
    layout = kv.slot_layout(1)
    host = HostSlots.from_tensor(torch.zeros(NUM_SLOTS, layout.slot_bytes, dtype=torch.uint8))
    planner = Planner(kv, layout, host, to_host=False)
    strided = np.arange(0, 16, dtype=np.int64)[::2]
    cases = [
        (GPUSpec(np.array([3, 4, 9], dtype=np.int32), (3,), (0,)), CPUSpec.of([5, 6, 1])),
        (GPUSpec(strided, (8,), (0,)), CPUSpec(strided + 1)),
    ]
    for gpu, cpu in cases:
        expected = plan_transfer(kv, layout, host, gpu, cpu, to_host=False).merged()
        _same(planner(gpu, cpu), expected)


def test_threads_planning_at_once_get_their_own_plans(native: None) -> None:
    """One planner, four threads with specs of their own (a factor of 2: first indices
    matter), every plan checked against numpy's: no call sees another's specs."""
    import sys
    import threading

    kv = _kv("LBNHC", two_groups=True)
    layout = kv.slot_layout(2)
    host = HostSlots.from_tensor(torch.zeros(NUM_SLOTS, layout.slot_bytes, dtype=torch.uint8))
    planner = Planner(kv, layout, host, to_host=True)
    wrong: list[int] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(300):
            sizes = [int(n) for n in rng.integers(1, 6, 2)]
            firsts = [int(f) for f in rng.integers(0, 2, 2)]
            gpu, cpu = _specs(rng, sizes, firsts, 2, contiguous=False)
            expected = plan_transfer(kv, layout, host, gpu, cpu, to_host=True).merged()
            got = planner(gpu, cpu)
            if not all(
                np.array_equal(getattr(got, f), getattr(expected, f))
                for f in ("src", "dst", "size")
            ):
                wrong.append(seed)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two bytecodes
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        sys.setswitchinterval(interval)
    assert not any(thread.is_alive() for thread in threads)
    assert wrong == []
