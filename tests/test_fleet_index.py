"""The fleet index, sans-I/O: events in, prefixes out; sequence gaps, replays, restarts.

Each test is a script of batches with a comment per step, as an engine would send them. The
wire format and the feed over real ZMQ sockets are in `test_fleet_feed`; vLLM's own publisher
and hashes against ours in ``tests/e2e/test_fleet.py``.
"""

from __future__ import annotations

import hashlib
import pickle

import pytest

pytest.importorskip("msgspec")

from kvtier_async.fleet import BlockHasher, FleetIndex, Receipt, as_key
from kvtier_async.fleet.wire import (
    AllBlocksCleared,
    Batch,
    BlockRemoved,
    BlockStored,
    MalformedBatch,
    decode_batch,
    encode_batch,
)

HASHER = BlockHasher(4)
TOKENS = list(range(100, 132))  # 8 blocks of 4
HASHES = HASHER.hashes(TOKENS)
KEYS = HASHER.keys(TOKENS)


def stored(n: int, medium: str = "GPU", tier: str | None = None, start: int = 0) -> Batch:
    return Batch(0.0, [BlockStored(HASHES[start:n], medium=medium, ownership=tier)])


def removed(hashes: list[bytes], medium: str = "GPU", tier: str | None = None) -> Batch:
    return Batch(0.0, [BlockRemoved(hashes, medium=medium, ownership=tier)])


def test_hashes_are_vllms_chain_of_pickled_tuples() -> None:
    # vLLM: NONE_HASH = sha256(pickle(seed)); block i = sha256(pickle((parent, tokens, None))).
    def h(value: object) -> bytes:
        return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    first = h((h("vllm-none-hash"), (100, 101, 102, 103), None))
    assert BlockHasher(4, seed="vllm-none-hash").hashes(TOKENS)[0] == first
    assert BlockHasher(4, seed="7").hashes(TOKENS)[0] != first  # PYTHONHASHSEED changes all
    assert len(HASHER.hashes([*TOKENS, 1, 2])) == 8  # only full blocks
    assert HASHER.hashes(TOKENS, limit=3) == HASHES[:3]
    assert as_key(HASHES[0]) == int.from_bytes(HASHES[0][-8:], "big")
    assert as_key(2**70 + 5) == 5  # vLLM's int hashes keep 64 bits


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 0}, "block_size: must be a positive int"),
        ({"block_size": 16, "algo": "xxhash"}, "algo: must be one of sha256"),
    ],
)
def test_hasher_refuses_bad_input(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BlockHasher(**kwargs)  # type: ignore[arg-type]


def test_match_counts_the_longest_prefix_per_engine_medium_and_tier() -> None:
    index = FleetIndex(["a", "b"])
    assert index.receive("a", 0, stored(5)) is Receipt.APPLIED  # a: GPU 0-4
    assert index.receive("a", 1, stored(3, "CPU")) is Receipt.APPLIED  # a: CPU 0-2
    assert index.receive("b", 0, stored(8, "STORAGE", "fs[0]")) is Receipt.APPLIED  # shared
    index.receive("b", 1, Batch(0.0, [BlockStored([HASHES[0], HASHES[2]], medium="CPU")]))
    m = index.match(KEYS)
    assert (m.blocks, m.gpu, m.cpu, m.storage) == (
        8,
        {"a": 5, "b": 0},
        {"a": 3, "b": 1},
        {"fs[0]": 8},
    )
    assert (m.local("a"), m.local("b"), m.shared) == (5, 1, 8)
    # a's GPU loses block 2: its prefix stops at 2, whatever follows.
    index.receive("a", 2, removed([HASHES[2]]))
    assert index.match(KEYS).gpu["a"] == 2
    # the shared tier's GC removes block 6 (announced by any engine sharing it).
    index.receive("a", 3, removed([HASHES[6]], "STORAGE", "fs[0]"))
    assert index.match(KEYS).storage == {"fs[0]": 6}


def test_offload_factor_reads_every_nth_key_for_cpu_and_storage() -> None:
    index = FleetIndex(["a"], offload_factor=2)
    # CPU and STORAGE name an offloaded block by its last GPU block's hash: 1, 3, 5.
    index.receive(
        "a", 0, Batch(0.0, [BlockStored([HASHES[1], HASHES[3], HASHES[5]], medium="CPU")])
    )
    index.receive("a", 1, stored(3))  # GPU 0-2
    m = index.match(KEYS)
    assert (m.cpu["a"], m.gpu["a"]) == (6, 3)


def test_all_blocks_cleared_drops_the_engines_local_blocks_not_storage() -> None:
    index = FleetIndex(["a"])
    index.receive(
        "a",
        0,
        Batch(
            0.0,
            [
                BlockStored(HASHES, medium="GPU"),
                BlockStored(HASHES, medium="CPU"),
                BlockStored(HASHES, medium="STORAGE", ownership="s3"),
            ],
        ),
    )
    index.receive("a", 1, Batch(0.0, [AllBlocksCleared()]))
    m = index.match(KEYS)
    assert (m.gpu, m.cpu, m.storage) == ({"a": 0}, {"a": 0}, {"s3": 8})


def test_a_gap_waits_for_the_replay_and_applies_in_order() -> None:
    index = FleetIndex(["a"])
    index.receive("a", 0, stored(1))
    # 1 and 2 are lost on the way; 3 arrives: a replay from 1 opens, 3 waits.
    assert index.receive("a", 3, removed([HASHES[0]])) is Receipt.REPLAY
    assert index.replay_from("a") == 1
    assert index.receive("a", 4, stored(1, start=0)) is Receipt.WAITING  # 4 re-stores 0
    index.replayed("a", 1, stored(2))
    index.replayed("a", 2, stored(3))
    assert index.replay_done("a") is True
    # In order: 0..3 stored (by 1, 2), 0 removed (3), 0 stored again (4).
    (st,) = index.stats()
    assert (st.next_seq, st.gaps, st.replayed, st.resyncs, st.gpu_blocks) == (5, 1, 2, 0, 3)
    assert index.match(KEYS).gpu["a"] == 3


def test_a_replay_that_does_not_reach_the_gap_resyncs_the_engine() -> None:
    index = FleetIndex(["a"])
    index.receive(
        "a",
        0,
        Batch(
            0.0,
            [
                BlockStored(HASHES, medium="GPU"),
                BlockStored(HASHES, medium="STORAGE", ownership="fs"),
            ],
        ),
    )
    assert index.receive("a", 5, stored(2, start=0)) is Receipt.REPLAY
    # No replay endpoint (or its buffer moved on): the engine's local blocks are forgotten,
    # so the index never claims a block a missed BlockRemoved took away; STORAGE stays.
    assert index.replay_done("a") is False
    m = index.match(KEYS)
    assert (m.gpu["a"], m.storage["fs"], index.stats()[0].resyncs) == (2, 8, 1)
    assert index.receive("a", 6, stored(3)) is Receipt.APPLIED


def test_a_replay_from_past_the_publishers_buffer_forgets_first() -> None:
    index = FleetIndex(["a"])
    index.receive("a", 0, stored(8))
    assert index.receive("a", 9, stored(1)) is Receipt.REPLAY  # missed 1..8
    index.replayed("a", 4, stored(2))  # the buffer starts at 4: 1..3 are gone for good
    index.replayed("a", 5, Batch(0.0, []))
    index.replayed("a", 6, Batch(0.0, []))
    index.replayed("a", 7, Batch(0.0, []))
    index.replayed("a", 8, Batch(0.0, []))
    assert index.replay_done("a") is True  # 9 follows 8
    (st,) = index.stats()
    assert (st.resyncs, st.gpu_blocks, st.next_seq) == (1, 2, 10)


def test_an_index_started_after_its_engines_replays_from_zero() -> None:
    index = FleetIndex(["a"])
    assert index.receive("a", 7, stored(1)) is Receipt.REPLAY
    assert index.replay_from("a") == 0
    for seq in range(7):
        index.replayed("a", seq, stored(seq + 1) if seq < 4 else Batch(0.0, []))
    assert index.replay_done("a") is True
    assert index.match(KEYS).gpu["a"] == 4 and index.stats()[0].resyncs == 0


def test_a_restarted_engine_starts_empty() -> None:
    index = FleetIndex(["a"])
    both = [
        BlockStored(HASHES, medium="GPU"),
        BlockStored(HASHES, medium="STORAGE", ownership="fs"),
    ]
    index.receive("a", 0, Batch(0.0, both))
    index.receive("a", 1, stored(8, "CPU"))
    assert index.receive("a", 0, stored(2)) is Receipt.RESTARTED  # its sequence began again
    m = index.match(KEYS)
    assert (m.gpu["a"], m.cpu["a"], m.storage["fs"]) == (2, 0, 8)
    index.receive("a", 1, stored(8))
    index.receive("a", 2, stored(8, "CPU"))
    # Restarted again, its first batch lost: 1 < 3 is a new publisher too; replay from 0.
    assert index.receive("a", 1, stored(1)) is Receipt.REPLAY
    assert (index.replay_from("a"), index.match(KEYS).gpu["a"]) == (0, 0)
    index.replayed("a", 0, stored(3))
    assert index.replay_done("a") is True
    assert index.match(KEYS).gpu["a"] == 3 and index.stats()[0].restarts == 2


def test_forget_drops_an_engine_and_its_next_batch_is_a_first_one() -> None:
    index = FleetIndex(["a"])
    index.receive("a", 0, stored(8))
    index.forget("a")  # a router found it dead
    assert index.match(KEYS).gpu["a"] == 0
    assert index.receive("a", 3, stored(1)) is Receipt.REPLAY  # replay from 0


def test_unknown_engines_and_malformed_batches_change_nothing() -> None:
    index = FleetIndex(["a"])
    index.receive("a", 0, stored(8))
    assert index.receive("zz", 0, stored(8)) is Receipt.UNKNOWN_ENGINE
    index.malformed("a", 1)
    (st,) = index.stats()
    assert (index.unknown_batches, st.malformed, st.gpu_blocks, st.next_seq) == (1, 1, 0, 2)


def test_memory_is_bounded_oldest_out() -> None:
    index = FleetIndex(["a"], max_blocks=3)
    index.receive("a", 0, stored(8))
    assert index.stats()[0].gpu_blocks == 3
    assert index.match(KEYS).gpu["a"] == 0  # 0..4 went first: no prefix left


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"engines": []}, "engines: at least one"),
        ({"engines": ["a", "a"]}, "must be unique"),
        ({"engines": ["a"], "max_blocks": 0}, "max_blocks: must be a positive int"),
    ],
)
def test_index_refuses_bad_config(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FleetIndex(**kwargs)  # type: ignore[arg-type]


def test_wire_round_trip_and_what_is_refused() -> None:
    batch = Batch(
        1.5,
        [
            BlockStored([b"\x01" * 32, 7], medium="CPU", group_idx=0),
            BlockRemoved([3], medium="STORAGE", ownership="fs[0]"),
            AllBlocksCleared(),
        ],
        0,
    )
    assert decode_batch(encode_batch(batch)) == batch
    gpu = decode_batch(encode_batch(Batch(0.0, [BlockStored([1])])))
    assert gpu.events[0].medium == "GPU"  # type: ignore[union-attr]
    with pytest.raises(
        MalformedBatch, match=r"events\[0\].medium: must be one of GPU, CPU, STORAGE"
    ):
        decode_batch(encode_batch(Batch(0.0, [BlockStored([1], medium="TAPE")])))
    with pytest.raises(MalformedBatch):
        decode_batch(b"\x93not msgpack")
    with pytest.raises(MalformedBatch, match="block_hashes"):
        decode_batch(encode_batch([0.0, [{"type": "BlockStored", "medium": "GPU"}]]))  # type: ignore[arg-type]
