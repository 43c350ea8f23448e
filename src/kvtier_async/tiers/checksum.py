"""The block checksum shared by the fs and obj tiers: CRC-32C (``crc32c``, hardware SSE4.2).

Picked by measurement on the 2-core development box (Xeon, AVX-512; see `kvtier bench fs`):

==========================================  ===========  ============
256 KiB-2 MiB buffers                       xxh3_64      crc32c (HW)
==========================================  ===========  ============
one buffer, cache-hot, one thread           34-45 GB/s   16-18 GB/s
1 GiB of distinct (cold) memory, 1 thread   5.7-6.2      5.3-6.1
2 MiB buffers while another Python thread   0.33 GB/s    1.41 GB/s
runs (the GIL contended, as in the tier)
==========================================  ===========  ============

A block is checksummed right after a DMA (GPU -> CPU before a store, disk -> CPU in a load),
so its bytes are cold and both are bound by memory bandwidth; what separates them is the
GIL: ``crc32c`` releases it for large buffers, ``xxhash`` holds it, which stalls the event
loop and every other worker thread for the whole computation. It guards against torn and
corrupted data, not against tampering.
"""

from __future__ import annotations

from typing import Final

import crc32c

__all__ = ["CHECKSUM_NAME", "checksum"]

CHECKSUM_NAME: Final = "crc32c"


def checksum(buf: bytes | bytearray | memoryview) -> int:
    """CRC-32C of ``buf`` (any contiguous buffer); the GIL is released for large buffers."""
    value: int = crc32c.crc32c(buf)
    return value
