"""Offload keys from token ids: the public prefix-hash chain.

A block's key names its whole prefix, as vLLM's prefix-cache hashes do: key ``i`` of a prompt
digests every token of blocks ``0..i``, so two prompts that share their first ``n`` full
blocks share their first ``n`` keys, and a cache keyed this way is a cross-request,
content-deduplicated prefix cache. vLLM's own connector takes its keys from vLLM's block
hashes; this chain is for everyone else (the async API, the demo, the benchmarks, tests).

    keys = prefix_keys(prompt_token_ids)               # one key per full 16-token block
    more = prefix_keys(new_tokens, parent=keys[-1])    # continue a chain incrementally

Each hash is SHA-256 over the parent's hash and the block's tokens (little-endian int64),
starting from a root that ``salt`` can separate (a model or adapter name: equal tokens under
different salts never share keys). A trailing partial block gets no key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from ._types import make_offload_key, split_offload_key

__all__ = ["prefix_keys"]

_ROOT = b"kvtier-prefix-v1"


def prefix_keys(
    token_ids: Sequence[int],
    *,
    block_tokens: int = 16,
    group_idx: int = 0,
    salt: bytes = b"",
    parent: bytes | None = None,
) -> list[bytes]:
    """The offload keys of the full ``block_tokens``-token blocks of ``token_ids``.

    ``parent`` continues a chain: the last key of the tokens that come before
    ``token_ids`` (its group index is ignored, so a chain can be continued into another
    group). ``salt`` is mixed into the root of a new chain only."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    tokens = np.asarray(token_ids, dtype="<i8")
    if tokens.ndim != 1:
        raise ValueError(f"token_ids must be a flat sequence of ints, got shape {tokens.shape}")
    if parent is not None:
        h = split_offload_key(parent)[0]
    else:
        h = hashlib.sha256(_ROOT + salt).digest()
    keys: list[bytes] = []
    data = tokens.tobytes()
    step = 8 * block_tokens
    for start in range(0, len(data) - step + 1, step):
        h = hashlib.sha256(h + data[start : start + step]).digest()
        keys.append(make_offload_key(h, group_idx))
    return keys
