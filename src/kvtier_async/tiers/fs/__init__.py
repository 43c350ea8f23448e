"""The file-system secondary tier: one checksummed file per block, O_DIRECT where possible.

Block ``key`` lives at ``<root_dir>/`` + `block_relpath`, one file in the block file format
(a checksummed header page, then the payload), written in full and published atomically, read
straight into the slot and verified before a load reports success; a torn, truncated, corrupt
or misplaced file is never handed out, and is deleted. Files are private (0600, directories
0700) unless ``mode`` says otherwise. Each module's docstring tells its part:

- `tier`: `FsTier` (the async face, worker threads, statistics) and its configuration.
- `files`: `BlockFiles`, the blocking half: store and load on either I/O path, directories.
- `kvtier_async.tiers.blockfile`: the file format and block names (shared with the obj tier).
- `blockio`: the Python block I/O path and its system-call seams for fault injection.
- `publish`: file modes, creating and publishing a file, the probe, ``config.json``.
- `tempfiles`: named temporaries, and which of them dead writers left behind.
- `records`: the ``max_bytes`` access record, removed keys, store errors, the scan at open.
- `native`, `native_batch`, `native_source`: the C batch path (binding and worker pools, one
  batch's arrays, the C source).
"""

from kvtier_async.tiers.blockfile import HEADER_BYTES, CorruptBlockError, pack_header, verify_block
from kvtier_async.tiers.fs.publish import PUBLISH_ORDER
from kvtier_async.tiers.fs.records import REMOVED_QUEUE
from kvtier_async.tiers.fs.tier import (
    DEFAULT_READ_WORKERS,
    DEFAULT_WRITE_WORKERS,
    MIN_CHUNK_BYTES,
    FsTier,
    FsTierConfig,
    FsTierStatistics,
    from_config,
    parse_mode,
)

__all__ = [
    "DEFAULT_READ_WORKERS",
    "DEFAULT_WRITE_WORKERS",
    "HEADER_BYTES",
    "MIN_CHUNK_BYTES",
    "PUBLISH_ORDER",
    "REMOVED_QUEUE",
    "CorruptBlockError",
    "FsTier",
    "FsTierConfig",
    "FsTierStatistics",
    "from_config",
    "pack_header",
    "parse_mode",
    "verify_block",
]
