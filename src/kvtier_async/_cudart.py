"""The CUDA runtime, found once for the whole package: torch's bindings and its library.

Two ways in, both onto the runtime torch itself uses (so streams, contexts and pinned
allocations are torch's own), and nothing else in the package loads the runtime:

- `runtime`: torch's ``torch.cuda.cudart()`` bindings, or None without CUDA. The shared CPU
  region pins itself with its ``cudaHostRegister`` (`kvtier_async.memory.region`).
- `memcpy_async`: ``cudaMemcpyAsync`` through ctypes on the ``libcudart`` already mapped into
  the process (`loaded_library_path`), for the transfer handlers' copy-engine path.

The copy-engine path issues one copy per merged run. Through torch each costs two tensor
slices and a ``copy_`` dispatch, several microseconds of Python, which at 256 KiB pages is
longer than the DMA itself over PCIe Gen5 (~5 us), so the GPU would wait on the CPU. A
direct ``cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, stream)`` costs one ctypes call.

The library is the one already mapped into the process (found in ``/proc/self/maps``), so
streams and device contexts are torch's own. It is used only after a self-test (a copy
each way on a fresh stream, checked byte for byte); any doubt falls back to torch's
``copy_`` (`memcpy_async` returns None), and ``KVTIER_CUDART_MEMCPY=0`` forces that (read by
`kvtier_async._native.disabled`, the one parser of the opt-out switches).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from kvtier_async._log import get_logger
from kvtier_async._native import disabled

__all__ = ["MemcpyAsync", "clear_last_error", "loaded_library_path", "memcpy_async", "runtime"]

log = get_logger(__name__)

MemcpyAsync = Callable[[int, int, int, int], None]  # (dst, src, nbytes, stream handle)
_CUDA_MEMCPY_DEFAULT: Final = 4  # cudaMemcpyDefault: direction from unified addresses
# Where the NVIDIA driver's device nodes are: none of them, no CUDA device in this process.
_NVIDIA_NODES: Final = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg")  # dxg: WSL2


@functools.cache
def memcpy_async() -> MemcpyAsync | None:
    """A checked ``cudaMemcpyAsync``, or None when it cannot be had (use torch instead)."""
    if disabled("KVTIER_CUDART_MEMCPY"):
        return None
    path = loaded_library_path()
    if path is None:
        log.info("CUDA runtime library not found among loaded libraries; using torch copies")
        return None
    try:
        function = ctypes.CDLL(path).cudaMemcpyAsync
    except (OSError, AttributeError) as exc:
        log.info("cannot use cudaMemcpyAsync; using torch copies", error=str(exc))
        return None
    function.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    function.restype = ctypes.c_int

    def copy(dst: int, src: int, nbytes: int, stream: int) -> None:
        error = function(dst, src, nbytes, _CUDA_MEMCPY_DEFAULT, stream)
        if error:
            raise RuntimeError(f"cudaMemcpyAsync failed with cudaError_t {error}")

    return copy if _self_test(copy) else None


def runtime() -> Any:
    """torch's CUDA runtime bindings, or None without CUDA (torch absent or no device).

    On a machine without an NVIDIA device node, torch is not imported for this (seconds
    of a cache's open, for an answer known already): None unless the process has imported
    torch itself."""
    if "torch" not in sys.modules and not any(os.path.exists(node) for node in _NVIDIA_NODES):
        return None
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    try:
        return torch.cuda.cudart()  # type: ignore[no-untyped-call]
    except (AssertionError, RuntimeError) as exc:
        log.warning("CUDA runtime unavailable", error=str(exc))
        return None


def clear_last_error() -> int:
    """Reset the calling thread's last CUDA runtime error; the code it held (0: none).

    A failed runtime call (``cudaHostRegister`` refusing a mapping, say) leaves its code
    as the thread's last error, and torch reads that after its next kernel launch: the
    caller's next, unrelated kernel would raise it. A failure we handle is cleared here."""
    path = loaded_library_path()
    if path is None:
        return 0
    try:
        function = ctypes.CDLL(path).cudaGetLastError
    except (OSError, AttributeError):
        return 0
    function.argtypes = []
    function.restype = ctypes.c_int
    return int(function())


def loaded_library_path() -> str | None:
    """The path of the ``libcudart`` mapped into this process, or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        if "/libcudart.so" in path:
            return path
    return None


def _self_test(copy: MemcpyAsync) -> bool:
    """One D2H and one H2D copy of 64 KiB + 8 bytes on a fresh stream, checked."""
    try:
        import torch

        size = (64 << 10) + 8
        device = (torch.arange(size, device="cuda") % 251).to(torch.uint8)
        host = torch.zeros(size, dtype=torch.uint8, pin_memory=True)
        back = torch.zeros(size, dtype=torch.uint8, device="cuda")
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            copy(host.data_ptr(), device.data_ptr(), size, stream.cuda_stream)
            copy(back.data_ptr(), host.data_ptr(), size, stream.cuda_stream)
        stream.synchronize()
        ok = bool(torch.equal(host.to("cuda"), device)) and bool(torch.equal(back, device))
    except Exception as exc:
        log.info("cudaMemcpyAsync self-test failed; using torch copies", error=repr(exc))
        return False
    if not ok:
        log.warning("cudaMemcpyAsync self-test copied wrong bytes; using torch copies")
    return ok
