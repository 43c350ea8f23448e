"""Triton kernels for kvtier-async (the swap-blocks copy kernel and its launch helpers).

Kernel modules hold one kernel each and are imported lazily, so that importing this package
never needs Triton or a GPU: the names below load `kvtier_async.kernels.swap_blocks` on first access
(which also keeps ``TRITON_INTERPRET`` effective until a kernel is actually wanted).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "MIN_JOBS",
    "NUM_PROGRAMS",
    "THRESHOLD_BYTES",
    "build_descriptors",
    "chunk_bytes_for",
    "launch_device_table",
    "launch_swap_blocks",
    "triton_available",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("kvtier_async.kernels.swap_blocks"), name)
    raise AttributeError(f"module 'kvtier_async.kernels' has no attribute {name!r}")
