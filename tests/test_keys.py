"""`prefix_keys`: the public chain from token ids to offload keys."""

from __future__ import annotations

import pytest

from kvtier_async.ledger import prefix_keys, split_offload_key


def test_shared_prefixes_share_keys_and_diverge_after() -> None:
    a = prefix_keys(list(range(64)))
    b = prefix_keys([*range(40), 999, *range(41, 64)])
    assert len(a) == len(b) == 4
    assert a[:2] == b[:2]  # blocks 0-1 (tokens 0-31) are equal
    assert a[2] != b[2] and a[3] != b[3]  # token 40 differs: block 2 and everything after


def test_a_partial_block_has_no_key() -> None:
    assert len(prefix_keys(list(range(47)))) == 2
    assert prefix_keys(list(range(15))) == []


def test_a_chain_continues_with_parent() -> None:
    whole = prefix_keys(list(range(96)))
    head = prefix_keys(list(range(32)))
    tail = prefix_keys(list(range(32, 96)), parent=head[-1])
    assert head + tail == whole


def test_salt_group_and_block_size_separate_keys() -> None:
    tokens = list(range(64))
    base = prefix_keys(tokens)
    assert prefix_keys(tokens, salt=b"other-model") != base
    grouped = prefix_keys(tokens, group_idx=3)
    assert [split_offload_key(k) for k in grouped] == [(split_offload_key(k)[0], 3) for k in base]
    assert len(prefix_keys(tokens, block_tokens=32)) == 2
    assert prefix_keys(tokens, block_tokens=32)[0] != base[1]  # same tokens, other chunking


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="block_tokens must be >= 1"):
        prefix_keys([1, 2], block_tokens=0)
    with pytest.raises(ValueError, match="flat sequence"):
        prefix_keys([[1, 2], [3, 4]])
