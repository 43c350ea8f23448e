"""A ``/match`` query: its body checked, its answer in tokens (the index's and the router's)."""

from __future__ import annotations

from typing import Any, Final

from .hashing import BlockHasher, as_key
from .index import FleetIndex

__all__ = ["match_json", "parse_match"]

MAX_TOKENS: Final = 1 << 20


def parse_match(body: Any, hasher: BlockHasher) -> list[int]:
    """The block keys a ``/match`` body names; `ValueError` naming the field otherwise."""
    if not isinstance(body, dict):
        raise ValueError("body: must be a JSON object with token_ids or block_hashes")
    if ("token_ids" in body) == ("block_hashes" in body):
        raise ValueError("body: give exactly one of token_ids and block_hashes")
    if "token_ids" in body:
        tokens = body["token_ids"]
        if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
            raise ValueError("token_ids: must be a list of non-negative ints")
        if len(tokens) > MAX_TOKENS:
            raise ValueError(f"token_ids: at most {MAX_TOKENS} tokens, got {len(tokens)}")
        return hasher.keys(tokens)
    hashes = body["block_hashes"]
    if not isinstance(hashes, list) or len(hashes) > MAX_TOKENS:
        raise ValueError(f"block_hashes: must be a list of at most {MAX_TOKENS} hex strings")
    try:
        return [as_key(bytes.fromhex(h)) for h in hashes]
    except (TypeError, ValueError):
        raise ValueError("block_hashes: each must be a hex string") from None


def match_json(index: FleetIndex, hasher: BlockHasher, body: Any) -> dict[str, Any]:
    """The answer to a ``/match`` body: the longest prefix in tokens per engine and medium,
    and per shared tier; `ValueError` naming the field for a bad body."""
    m = index.match(parse_match(body, hasher))
    size = hasher.block_size
    return {
        "blocks": m.blocks,
        "block_size": size,
        "gpu": {k: v * size for k, v in m.gpu.items()},
        "cpu": {k: v * size for k, v in m.cpu.items()},
        "storage": {k: v * size for k, v in m.storage.items()},
    }
