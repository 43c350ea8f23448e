"""A fleet of engines on one shared tier: a prefix index fed by vLLM's KV events, and a router.

The reason to keep KV blocks in files and object stores is that the next request for a
prefix often lands on another engine. Each engine (``vllm serve`` with our connector, its
own ``instance_id``, the same ``secondary_tiers`` root or bucket) publishes vLLM's KV events
over ZMQ; the index keeps which engine holds which block on its GPU and in its CPU tier, and
which blocks the shared tiers hold; a router asks it, for a prompt, how long a prefix each
holds, and sends the request where it is cheapest to serve.

``hashing``  `BlockHasher`: vLLM's block hashes of token ids, outside vLLM.
``wire``     vLLM's KV-event batches on the wire: decode and check.
``index``    `FleetIndex`: sans-I/O state, sequence numbers, replays and resyncs, `match`.
``feed``     `Feed`: the ZMQ SUB socket the engines publish to, and the replay client.
``router``   `Router`: the reference router, an async proxy in front of the engines.
``service``  the HTTP face of the index and the processes ``kvtier fleet index|router``.

Needs the ``[fleet]`` extra (pyzmq, msgspec, aiohttp); asyncio only.
"""

from __future__ import annotations

from .hashing import BlockHasher, as_key
from .index import FleetIndex, Match, Receipt

__all__ = ["BlockHasher", "FleetIndex", "Match", "Receipt", "as_key"]
