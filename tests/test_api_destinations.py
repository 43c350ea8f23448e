"""A load writes only where it may (issue 23, item 6): a destination that is not writable
(a read-only buffer, an array or tensor over an immutable ``bytes`` object or a read-only
mmap) is refused with a `ValueError` naming its block index before any copy starts, so
neither it nor the blocks beside it are touched.

The case that crashed the process before (a tensor over a read-only mapping: SIGSEGV) runs
in a child process, so a crash fails this test instead of ending the suite.
"""

from __future__ import annotations

import mmap
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest

from kvtier_async.api import TieredKVCache
from kvtier_async.ledger import make_offload_key

BLOCK = 4096
CONFIG = {"block_bytes": BLOCK, "num_slots": 4}
WAIT_S = 120.0  # fail-safe only


def _read_only_mmap() -> Any:
    return mmap.mmap(-1, BLOCK, prot=mmap.PROT_READ)  # anonymous, read-only: all zeros


def _torch_frombuffer(data: Any) -> Any:
    torch = pytest.importorskip("torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The given buffer is not writable"
        return torch.frombuffer(data, dtype=torch.uint8)


DESTINATIONS: dict[str, Callable[[bytes], Any]] = {
    "bytes": lambda data: data,
    "memoryview of bytes": memoryview,
    "numpy over bytes": lambda data: np.frombuffer(data, dtype=np.uint8),
    "numpy over a read-only mmap": lambda data: np.frombuffer(_read_only_mmap(), np.uint8),
    "tensor over bytes": _torch_frombuffer,
    "tensor over a numpy array": lambda data: pytest.importorskip("torch").from_numpy(
        np.zeros(BLOCK, dtype=np.uint8)
    ),
}


@pytest.mark.parametrize("kind", list(DESTINATIONS))
def test_a_destination_that_may_not_be_written_is_refused_before_any_copy(kind: str) -> None:
    immutable = bytes([9]) * BLOCK
    keys = [make_offload_key(bytes([i]) * 16, 0) for i in range(2)]

    async def main() -> None:
        async with TieredKVCache(CONFIG) as cache:
            stored = [np.full(BLOCK, 1 + i, dtype=np.uint8) for i in range(2)]
            await cache.store(keys, stored)
            first = np.zeros(BLOCK, dtype=np.uint8)
            with pytest.raises(ValueError, match=r"^blocks\[1\] ") as caught:
                await cache.load(keys, [first, DESTINATIONS[kind](immutable)])
            assert "read-only" in str(caught.value) or "did not allocate" in str(caught.value)
            assert not first.any()  # refused before any copy: the good block untouched too
            assert await cache.load(keys, [first, np.zeros(BLOCK, np.uint8)]) == 2  # nothing lost
            assert (first == 1).all()

    anyio.run(main)
    assert immutable == bytes([9]) * BLOCK  # the immutable object was never written


CHILD = textwrap.dedent(
    """
    import mmap, sys, warnings
    import anyio, numpy as np, torch
    from kvtier_async.api import TieredKVCache
    from kvtier_async.ledger import make_offload_key

    async def main():
        key = make_offload_key(b"k" * 16, 0)
        async with TieredKVCache({"block_bytes": 4096, "num_slots": 2}) as cache:
            await cache.store([key], [np.full(4096, 7, dtype=np.uint8)])
            ro = mmap.mmap(-1, 4096, prot=mmap.PROT_READ)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tensor = torch.frombuffer(ro, dtype=torch.uint8)
            try:
                await cache.load([key], [tensor])
            except ValueError as exc:
                print("refused:", exc)
                return
            print("loaded into a read-only mapping")

    anyio.run(main)
    """
)


def test_a_tensor_over_a_read_only_mapping_is_refused_not_a_crash() -> None:
    pytest.importorskip("torch")
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=WAIT_S
    )
    assert done.returncode == 0, f"the child died ({done.returncode}): {done.stderr[-2000:]}"
    assert done.stdout.startswith("refused: blocks[0] is a CPU tensor"), done.stdout


def test_a_tensor_torch_allocated_stays_a_destination_after_stores_and_loads() -> None:
    """What the cache does with a tensor (store from it, load into it) never makes it look
    like memory torch did not allocate: loads into it keep working, call after call."""
    torch = pytest.importorskip("torch")
    keys = [make_offload_key(bytes([i]) * 16, 0) for i in range(2)]

    async def main() -> None:
        async with TieredKVCache(CONFIG) as cache:
            tensor = torch.arange(2 * BLOCK, dtype=torch.int32).to(torch.uint8).reshape(2, -1)
            await cache.store(keys, [tensor[0], tensor[1]])
            expected = tensor.clone()
            for _ in range(3):
                tensor.zero_()
                assert await cache.load(keys, [tensor[0], tensor[1]]) == 2
                assert torch.equal(tensor, expected)

    anyio.run(main)
