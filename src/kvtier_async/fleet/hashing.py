"""vLLM's prefix-cache block hashes, computed outside vLLM (for a router that has only tokens).

vLLM names a full block of ``block_size`` tokens by a hash chained through the blocks before
it (``vllm.v1.core.kv_cache_utils.hash_block_tokens``): ``H(parent, tokens, extra_keys)``,
where the first block's parent is ``NONE_HASH = H(seed)`` and ``H`` is the engine's
``--prefix-caching-hash-algo``. For the default, ``sha256``, ``H(x)`` is SHA-256 of
``pickle.dumps(x, protocol=HIGHEST_PROTOCOL)``, and the seed is ``PYTHONHASHSEED`` when the
engine has it set, else the fixed ``"vllm-none-hash"`` (vLLM 0.32 and 0.33). Every engine of a
fleet must agree on both, or their blocks are never the same blocks: that is also what lets
them share a tier.

Only prompts without extra keys are hashed here (no LoRA adapter, no multimodal input, no
``cache_salt``: their extra keys enter the hash); `BlockHasher` refuses nothing, so a router
that serves those must pass the block hashes themselves. The differential test
(``tests/e2e/test_fleet.py``) compares these hashes with vLLM's own for the same tokens.

Routing needs 64 bits, not 256: `as_key` keeps a hash's last 8 bytes as an int, as vLLM's
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` does for its events, so an index fed by either kind of
event holds the same keys (a collision can only misroute a request, never serve a wrong
block: the engine checks the whole hash).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Sequence
from typing import Final

__all__ = ["DEFAULT_SEED", "BlockHasher", "as_key"]

DEFAULT_SEED: Final = "vllm-none-hash"
SUPPORTED_ALGOS: Final = ("sha256",)
_MASK: Final = (1 << 64) - 1


def as_key(block_hash: bytes | int) -> int:
    """The index's key of a block hash: its last 8 bytes as an unsigned int (an int hash, as
    vLLM publishes with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, is taken as it is)."""
    if isinstance(block_hash, int):
        return block_hash & _MASK
    return int.from_bytes(block_hash[-8:], "big")


class BlockHasher:
    """vLLM's block hashes of a prompt's token ids: ``hashes(token_ids)``, one per full block.

    ``seed`` is the engines' ``PYTHONHASHSEED`` if they have one set (None: read this
    process's, then vLLM's fixed default). Only ``algo="sha256"`` (vLLM's default) is
    computed here; any other is a `ValueError` naming the supported ones.
    """

    def __init__(self, block_size: int, *, seed: str | None = None, algo: str = "sha256") -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size: must be a positive int, got {block_size!r}")
        if algo not in SUPPORTED_ALGOS:
            raise ValueError(f"algo: must be one of {', '.join(SUPPORTED_ALGOS)}, got {algo!r}")
        self.block_size = block_size
        self.seed = seed if seed is not None else os.environ.get("PYTHONHASHSEED", DEFAULT_SEED)
        self.none_hash = _sha256(self.seed)

    def hashes(self, token_ids: Sequence[int], *, limit: int | None = None) -> list[bytes]:
        """The hash of each full block of ``token_ids`` (the first ``limit`` at most)."""
        size = self.block_size
        count = len(token_ids) // size
        if limit is not None:
            count = min(count, limit)
        out: list[bytes] = []
        parent = self.none_hash
        for i in range(count):
            parent = _sha256((parent, tuple(token_ids[i * size : (i + 1) * size]), None))
            out.append(parent)
        return out

    def keys(self, token_ids: Sequence[int], *, limit: int | None = None) -> list[int]:
        """`as_key` of each of `hashes` (what `FleetIndex` looks up)."""
        return [as_key(h) for h in self.hashes(token_ids, limit=limit)]


def _sha256(value: object) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()
