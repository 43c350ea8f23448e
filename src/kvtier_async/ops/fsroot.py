"""The operations on an fs tier root: walk it, verify its blocks, delete damaged or least
recently used ones. Plain blocking code: the ``kvtier`` command runs it in its own process.

*A live root.* An instance may be storing, loading and deleting under the root while these
run. A file or directory that disappears between the walk and its use is skipped (counted as
``vanished``), never an error; a file published after the walk is not seen. Nothing here
writes a block. A deletion is of a block file only, never of a named temporary that a live
writer may still publish, and a damaged block is deleted only if it is still the file that
was read (a peer may have published a good copy since); a symbolic link is unlinked, never
followed. Walks and deletions go through directory descriptors (`kvtier_async._beneath`): a
link below the root is listed, never entered, and a directory swapped for one while a
command runs cannot redirect a deletion outside the root. The instance's own ``max_bytes`` record
does not hear of blocks deleted here: it counts them until it touches them again.

*Walk.* `walk` records every entry below the root (`layout.Root.add`): regular ``.bin``
files in a rank directory are blocks; named temporaries are judged by their writer's
identity (`temp_writer`: ``live``, ``dead``, or ``foreign`` when written on another host or in
another pid namespace), as the tier judges them at open; the rest is listed. Each namespace's
``config.json`` is read.

*Verify.* `verify` reads every block with buffered reads (``O_NOFOLLOW``) in ``jobs``
threads and judges it (`layout.check_block`) against the key its name gives.

*GC.* `gc_plan` scans each rank directory as the tier does at open
(`kvtier_async.tiers.fs.records.scan`) and orders the blocks by `layout.lru_victims`, the
tier's own ``max_bytes`` order; `gc_apply` deletes them, and the temporaries of dead writers.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final

from kvtier_async import _beneath as beneath
from kvtier_async._safefile import SAFE_READ_FLAGS, read_json
from kvtier_async.ops.layout import (
    CONFIG_NAME,
    NAMESPACE_RE,
    RANK_RE,
    Block,
    Namespace,
    OpsError,
    Root,
    Temp,
    check_block,
    lru_victims,
    pick_namespace,
    too_large,
)
from kvtier_async.ops.results import Damage, Disagreement, GcPlan, GcResult, Verification
from kvtier_async.tiers.blockfile import CorruptBlockError, block_key
from kvtier_async.tiers.fs.records import scan
from kvtier_async.tiers.fs.tempfiles import TEMP_RE, identity, process_start

__all__ = ["check_root", "gc_apply", "gc_plan", "repair", "temp_writer", "verify", "walk"]

_CONFIG_MAX: Final = 1 << 20
_CONFIG_DEPTH: Final = 32


def check_root(path: str) -> str:
    """``path`` if it is a directory; `OpsError` (a usage error) saying what it is if not."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise OpsError(f"{path}: no such directory") from None
    except OSError as exc:
        raise OpsError(f"{path}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise OpsError(f"{path}: not a directory")
    return path


# -- walking ---------------------------------------------------------------------------------


def walk(path: str) -> Root:
    """Everything below the root directory ``path`` (see the module docstring)."""
    root = Root(check_root(path), "fs")
    for relpath, st in beneath.walk(path):  # a link below the root: listed, never entered
        name = os.path.basename(relpath)
        regular = stat.S_ISREG(st.st_mode)
        writer = temp_writer(name) if TEMP_RE.fullmatch(name) else ""
        root.add(relpath, st.st_size, st.st_mtime_ns, regular=regular, writer=writer)
    for name in _namespace_names(path):  # an empty namespace directory is one too
        root.namespace(name)
    for ns in root.namespaces.values():
        _read_config(path, ns)
    return root


def _read_config(top: str, ns: Namespace) -> None:
    """Read ``ns``'s ``config.json`` into ``ns.config``, or say in ``config_note`` why not
    (a link, a FIFO, a device or a directory is never read; see `kvtier_async._safefile`)."""
    path = os.path.join(top, ns.name, CONFIG_NAME)
    try:
        data = read_json(path, max_bytes=_CONFIG_MAX, max_depth=_CONFIG_DEPTH)
    except FileNotFoundError:
        ns.config_note = "no config.json"
        return
    except OSError as exc:
        ns.config_note = f"config.json unreadable: {_problem(exc)}"
        return
    except ValueError as exc:  # too large, too deep, not JSON
        ns.config_note = f"config.json unreadable: {exc}"
        return
    if isinstance(data, dict):
        ns.config = data
    else:
        ns.config_note = "config.json is not a JSON object"


def temp_writer(name: str) -> str:
    """``live``, ``dead`` or ``foreign``: the writer of the named temporary ``name``, judged
    as the tier judges it (`kvtier_async.tiers.fs.tempfiles`); dead only when provably so."""
    match = TEMP_RE.fullmatch(name)
    if match is None or match[1] != identity().token:
        return "foreign"
    return "live" if process_start(int(match[2])) == int(match[3]) else "dead"


# -- verifying -------------------------------------------------------------------------------


@dataclass
class _Shared:
    """What the verify threads share, under ``lock``."""

    items: Iterator[tuple[Namespace, Block]]
    result: Verification
    progress: Callable[[int, int], None]
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: bool = False


def verify(
    path: str,
    root: Root,
    *,
    jobs: int = 4,
    progress: Callable[[int, int], None] = lambda blocks, nbytes: None,
) -> Verification:
    """Read and check every block (and every link at a block name) of ``root``, found
    under ``path``, in ``jobs`` threads; ``progress(blocks, bytes)`` hears of each one."""
    result = Verification(total=sum(len(ns.blocks) for ns in root.namespaces.values()))
    for ns in root.sorted_namespaces():
        for relpath in ns.links:
            result.damaged.append(Damage(relpath, "a symbolic link or special file (not followed)"))
    items = ((ns, block) for ns in root.sorted_namespaces() for block in ns.blocks)
    shared = _Shared(items, result, progress)
    started = time.monotonic()
    threads = [
        threading.Thread(
            target=_verify_worker, args=(path, shared), daemon=True, name=f"kvtier-verify-{i}"
        )
        for i in range(max(1, jobs))
    ]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join()
    finally:
        shared.stop = True  # an interrupt: the threads end after their current block
    result.seconds = time.monotonic() - started
    result.damaged.sort(key=lambda d: d.relpath)
    result.errors.sort()
    return result


def _verify_worker(top: str, shared: _Shared) -> None:
    buffer = bytearray()
    while not shared.stop:
        with shared.lock:
            item = next(shared.items, None)
        if item is None:
            return
        ns, block = item
        outcome, nbytes, buffer = _verify_one(top, ns, block, buffer)
        with shared.lock:
            shared.result.record(block.relpath, outcome, nbytes)
            shared.progress(1, nbytes)


def _verify_one(
    top: str, ns: Namespace, block: Block, buffer: bytearray
) -> tuple[Damage | Disagreement | str | None, int, bytearray]:
    """``(outcome, bytes read, buffer)``: outcome None (good), ``"vanished"``, an error
    text (could not be read: not judged), a `Damage`, or a `Disagreement` (sound by its
    own header, not what ``config.json`` says)."""
    key = block_key(block.relpath)
    if key is None:
        return (
            Damage(block.relpath, "not named like a block file (<hex key>.bin in <hh>_g<group>)"),
            0,
            buffer,
        )
    path = os.path.join(top, block.relpath)
    try:
        fd = os.open(path, SAFE_READ_FLAGS)  # a FIFO opens at once, and is not read
    except FileNotFoundError:
        return "vanished", 0, buffer
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return Damage(block.relpath, "a symbolic link (not followed)"), 0, buffer
        return f"{block.relpath}: {_problem(exc)}", 0, buffer
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return Damage(block.relpath, "not a regular file", (st.st_dev, st.st_ino)), 0, buffer
        damage = too_large(st.st_size)
        if damage is not None:
            return Damage(block.relpath, str(damage), (st.st_dev, st.st_ino)), 0, buffer
        if len(buffer) < st.st_size:
            buffer = bytearray(st.st_size)
        view = memoryview(buffer)
        got = _read_all(fd, view[: st.st_size])
        try:
            claimed = check_block(view[:got], key, ns.block_bytes)
        except CorruptBlockError as exc:
            return Damage(block.relpath, str(exc), (st.st_dev, st.st_ino)), got, buffer
        finally:
            view.release()
        if claimed is not None and ns.block_bytes is not None:
            return Disagreement(block.relpath, claimed, ns.block_bytes), got, buffer
        return None, got, buffer
    except OSError as exc:
        return f"{block.relpath}: {_problem(exc)}", 0, buffer
    finally:
        os.close(fd)


def _read_all(fd: int, view: memoryview) -> int:
    done = 0
    while done < view.nbytes:
        got = os.preadv(fd, [view[done:]], done)
        if got <= 0:
            break
        done += got
    return done


def repair(path: str, damaged: Sequence[Damage]) -> tuple[list[Damage], list[Damage]]:
    """Delete each damaged file under ``path`` if it is still the file that was judged (a
    link: unlinked, never followed; reached through directory descriptors, see
    `kvtier_async._beneath`); ``(removed, kept)``."""
    removed, kept = [], []
    for damage in damaged:
        if beneath.discard(path, os.path.join(path, damage.relpath), damage.identity):
            removed.append(damage)
        elif _still_there(path, damage.relpath):  # replaced since, or not ours to delete
            kept.append(damage)
        else:
            removed.append(damage)  # gone already: no damage left
    return removed, kept


def _still_there(path: str, relpath: str) -> bool:
    parent, _, name = relpath.rpartition("/")
    try:
        with beneath.opened_dir(path, parent) as fd:
            os.stat(name, dir_fd=fd, follow_symlinks=False)
    except (FileNotFoundError, beneath.LinkBelowRootError):
        return False
    return True


def _listing(path: str, relative: str) -> list[tuple[str, os.stat_result]]:
    try:
        return beneath.entries(path, relative)
    except (FileNotFoundError, beneath.LinkBelowRootError):
        return []


# -- gc --------------------------------------------------------------------------------------


def gc_plan(path: str, max_bytes: int, namespace: str | None = None) -> GcPlan:
    """What `gc_apply` deletes to bring the blocks under ``path`` (of ``namespace``, or all)
    to at most ``max_bytes``: the tier's own order (see the module docstring)."""
    check_root(path)
    names = _namespace_names(path)
    if namespace is not None:
        names = [pick_namespace(path, names, namespace)]
    blocks: list[Block] = []
    temps: list[Temp] = []
    links: list[str] = []
    for name in names:
        found, leftovers, skipped = _scan_namespace(path, name)
        blocks += found
        temps += leftovers
        links += skipped
    plan = GcPlan(path, max_bytes, names if namespace is not None else None)
    plan.links = links
    plan.blocks, plan.bytes = len(blocks), sum(b.size for b in blocks)
    plan.victims = lru_victims(blocks, max_bytes)
    plan.temps = [temp for temp in temps if temp.writer == "dead"]
    plan.live_temps = sum(temp.writer != "dead" for temp in temps)
    return plan


def _namespace_names(path: str) -> list[str]:
    return [
        name
        for name, st in _listing(path, "")
        if NAMESPACE_RE.fullmatch(name) and stat.S_ISDIR(st.st_mode)
    ]


def _scan_namespace(path: str, name: str) -> tuple[list[Block], list[Temp], list[str]]:
    """The blocks and temporaries of namespace ``name``, scanned as the tier scans its rank
    directory at open (`records.scan`), and the links found where rank directories go
    (listed, never entered)."""
    listed = _listing(path, name)
    ranks = [n for n, st in listed if RANK_RE.fullmatch(n) and stat.S_ISDIR(st.st_mode)]
    links = [f"{name}/{n}" for n, st in listed if RANK_RE.fullmatch(n) and stat.S_ISLNK(st.st_mode)]
    blocks: list[Block] = []
    temp_paths: set[str] = set()
    for rank_name in ranks or ["r0"]:  # no rank directory: the namespace's temporaries
        found, temps = scan(path, name, rank_name, want_blocks=True)
        rank = int(rank_name[1:])
        for mtime_ns, block_path, size in found:
            blocks.append(Block(os.path.relpath(block_path, path), rank, size, mtime_ns))
        temp_paths.update(temps)
    temps_found = []
    for temp_path in sorted(temp_paths):
        with contextlib.suppress(FileNotFoundError):
            size = os.lstat(temp_path).st_size
            relpath = os.path.relpath(temp_path, path)
            temps_found.append(Temp(relpath, size, temp_writer(os.path.basename(temp_path))))
    return blocks, temps_found, links


def gc_apply(plan: GcPlan) -> GcResult:
    """Delete what ``plan`` lists: its blocks, oldest first, and the temporaries of dead
    writers (judged again just before), each reached through directory descriptors (a
    directory swapped for a link since the plan: not followed, the file left)."""
    result = GcResult(plan)
    for block in plan.victims:
        try:
            gone = beneath.unlink(plan.location, block.relpath)
        except OSError as exc:
            result.failed.append(f"{block.relpath}: {_problem(exc)}")
            continue
        if gone:
            result.deleted.append(block)
        else:
            result.vanished += 1
    dead = [t for t in plan.temps if temp_writer(os.path.basename(t.relpath)) == "dead"]
    result.temps_removed = [t for t in dead if beneath.discard(plan.location,
                            os.path.join(plan.location, t.relpath))]  # fmt: skip
    return result


def _problem(exc: OSError) -> str:
    return exc.strerror or str(exc)
