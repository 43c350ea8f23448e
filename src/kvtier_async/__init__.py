"""kvtier-async: a three-tier KV cache (GPU HBM -> CPU DRAM -> files / S3) for LLM serving.

An anyio-native engine that reproduces vLLM's ``kv_offload``, with a vLLM connector adapter.
"""

__version__ = "0.1.0"
