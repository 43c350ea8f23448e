"""vLLM's KV events on the wire: one ZMQ message per batch, decoded and checked.

vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``, 0.32 and 0.33) sends each
batch as three frames: the topic (``KVEventsConfig.topic``, which a fleet sets to the engine's
name), an 8-byte big-endian sequence number counting from 0 at the publisher's start, and a
msgpack payload, ``[ts, [event, ...], data_parallel_rank]``. An event is a map tagged by its
``type``: ``BlockStored`` (``block_hashes``, ``parent_block_hash``, ``token_ids``,
``block_size``, ``medium``, ``group_idx``, ``ownership``, ...), ``BlockRemoved``
(``block_hashes``, ``medium``, ...) or ``AllBlocksCleared``. A block hash is bytes (vLLM's
default) or an int (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).

The replay socket (``replay_endpoint``, a ROUTER) answers an 8-byte start sequence with every
batch it still buffers from there, as ``(b"", topic, seq, payload)``, then an end marker
whose sequence is -1.

`decode_batch` turns a payload into `Batch`, or raises `MalformedBatch` saying what is wrong;
fields this module does not know are ignored (a newer vLLM adds some), those it needs are
checked. `encode_batch` writes the same format (tests, and a publisher of our own).
"""

from __future__ import annotations

from typing import Final

import msgspec

__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "Batch",
    "BlockRemoved",
    "BlockStored",
    "MalformedBatch",
    "decode_batch",
    "decode_seq",
    "encode_batch",
]

END_SEQ: Final = -1
MEDIA: Final = ("GPU", "CPU", "STORAGE")

BlockHash = bytes | int


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    group_idx: int | None = None
    ownership: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


class MalformedBatch(ValueError):
    """A payload that is not a batch of vLLM KV events (the message says where)."""


_decoder: Final = msgspec.msgpack.Decoder(Batch)
_encoder: Final = msgspec.msgpack.Encoder()


def decode_batch(payload: bytes) -> Batch:
    """The batch in ``payload``; `MalformedBatch` if it is not one, or names a medium
    other than GPU, CPU and STORAGE (None, vLLM's GPU default before 0.32, reads as GPU)."""
    try:
        batch = _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedBatch(str(exc)) from None
    for i, event in enumerate(batch.events):
        if isinstance(event, AllBlocksCleared):
            continue
        if event.medium is None:
            event.medium = "GPU"
        elif event.medium not in MEDIA:
            allowed = ", ".join(MEDIA)
            raise MalformedBatch(
                f"events[{i}].medium: must be one of {allowed}, got {event.medium!r}"
            )
    return batch


def encode_batch(batch: Batch) -> bytes:
    return _encoder.encode(batch)


def decode_seq(frame: bytes) -> int:
    """A sequence frame (8 bytes, big-endian, signed: the replay's end marker is -1)."""
    if len(frame) != 8:
        raise MalformedBatch(f"sequence frame: must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
