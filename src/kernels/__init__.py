"""Triton kernels for kvtier-async (the swap-blocks copy kernel and its launch helpers).

Kernel modules hold one kernel each and are imported lazily, so that importing this package
never needs Triton or a GPU.
"""
