"""Which mount holds a path: its device and file-system type, read from /proc/self/mounts.

For messages and tools (the CPU region's pin warning names the file system; the fs
benchmark checks it runs on a disk or on tmpfs); nothing decides behaviour on it.
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["mount"]


def mount(path: str | os.PathLike[str]) -> tuple[str, str]:
    """``(device name, file-system type)`` of the mount holding ``path`` (its real path),
    ``("unknown", "unknown")`` where /proc/self/mounts cannot say. Of several mounts on
    the same point, the last (the visible one) wins."""
    best, found = "", ("unknown", "unknown")
    real = os.path.realpath(path)
    with contextlib.suppress(OSError), open("/proc/self/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) < 3:
                continue
            point = fields[1].replace("\\040", " ")  # the table escapes spaces
            inside = real == point or real.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best):
                best, found = point, (os.path.basename(fields[0]), fields[2])
    return found
