"""Deterministic K/V for the fake model: every token's cells are a function of its prefix.

`prefix_hashes` fingerprints each token position by the token ids up to and including it
(splitmix64 over the tokens, one 64-bit value per position); `KVPattern` expands a position's
fingerprint and a layer number into the ``[num_kv_heads, head_size + head_size_v]`` cells the
fake model writes, and picks the token it samples. Equal prefixes therefore have equal K/V, as
in a real model, and any block's content can be recomputed to check a load.

These per-token fingerprints only generate content; they are not offload keys (the harness's
block keys are vLLM's own prefix-cache block hashes; outside vLLM, the offload keys of token
ids come from `kvtier_async.ledger.prefix_keys`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["KVMismatch", "KVPattern", "prefix_hashes"]

_FIRST_SAMPLED_TOKEN = 3  # 0..2 are pad / bos / eos in the tiny config


class KVMismatch(AssertionError):
    """A KV cache slot does not hold what the fake model wrote for that token."""


# --- deterministic K/V ---------------------------------------------------------------------

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_HASH_SEED = 0x5EED_0F_C0FFEE


def _mix64(x: int) -> int:
    """splitmix64's finalizer on a Python int."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def prefix_hashes(token_ids: Sequence[int], hashes: list[int] | None = None) -> list[int]:
    """``hashes[p]`` fingerprints ``token_ids[: p + 1]``; extends *hashes* in place if given."""
    out = [] if hashes is None else hashes
    h = out[-1] if out else _HASH_SEED
    for token in token_ids[len(out) :]:
        h = _mix64(h ^ (((token + 1) * _GOLDEN) & _M64))
        out.append(h)
    return out


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _mix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """The same finalizer on int64 tensors (wrapping multiplies, arithmetic shifts)."""
    x = (x ^ (x >> 30)) * _signed64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> 27)) * _signed64(0x94D049BB133111EB)
    return x ^ (x >> 31)


class KVPattern:
    """The K/V the fake model writes: for the token at position ``p`` of a sequence and layer
    ``l``, the ``[num_kv_heads, head_size + head_size_v]`` cell is a function of
    ``prefix_hashes(tokens)[p]`` and ``l`` only (so shared prefixes have equal KV, as in a real
    model). Element bits are pseudo-random with one exponent bit cleared: never NaN or Inf.
    """

    def __init__(self, num_kv_heads: int, head_size: int, head_size_v: int, dtype: torch.dtype):
        self.dtype = dtype
        self.cell = (num_kv_heads, head_size + head_size_v)
        self.width = torch.empty(0, dtype=dtype).element_size() * 8
        self.int_dtype = {8: torch.int8, 16: torch.int16, 32: torch.int32}[self.width]
        columns = num_kv_heads * (head_size + head_size_v)
        self._columns = torch.arange(columns, dtype=torch.int64)
        self._salts: dict[int, torch.Tensor] = {}

    def values(self, hashes: Sequence[int], layer: int) -> torch.Tensor:
        """The ``[len(hashes), num_kv_heads, head_size + head_size_v]`` cells, in ``dtype``."""
        salt = self._salts.get(layer)
        if salt is None:
            salt = _mix64_tensor(self._columns + (layer + 1) * (1 << 40))
            self._salts[layer] = salt
        h = torch.tensor([_signed64(v) for v in hashes], dtype=torch.int64)
        x = _mix64_tensor(h[:, None] ^ salt[None, :])
        low = x & ((1 << self.width) - 1) & ~(1 << (self.width - 2))
        signed = torch.where(low >= 1 << (self.width - 1), low - (1 << self.width), low)
        return signed.to(self.int_dtype).view(self.dtype).view(len(hashes), *self.cell)

    def next_token(self, last_hash: int, vocab_size: int) -> int:
        """The token the fake model samples after a prefix ending in *last_hash*."""
        span = vocab_size - _FIRST_SAMPLED_TOKEN
        return _FIRST_SAMPLED_TOKEN + _mix64(last_hash ^ _GOLDEN) % span
