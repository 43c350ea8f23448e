"""Nothing outside a root is ever deleted (issue 23, item 4): the fs tier's own GC, ``kvtier
gc`` and ``kvtier inspect --repair`` reach every file through directory descriptors, never
through a link below the root, and ``--repair`` never deletes because ``config.json``
disagrees with the blocks.

Each attack is built for real on disk: a rank directory that is a symbolic link to an outside
directory full of ``*.bin`` files (one of them named like a block), a fan-out directory
swapped for such a link between a GC's plan and its deletions, a ``config.json`` whose
``block_bytes`` is wrong. The outside directory is then checked file by file.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import anyio
import pytest

from _s3 import make_blocks, make_keys, opened
from kvtier_async import _beneath as beneath
from kvtier_async.cli import main
from kvtier_async.ops import fsroot
from kvtier_async.tiers.base import TierContext
from kvtier_async.tiers.blockfile import HEADER_BYTES, block_relpath
from kvtier_async.tiers.fs import FsTier
from kvtier_async.tiers.fs.publish import UntrustedRootError

CTX = TierContext(block_bytes=4096, model="model-a")
FILE = HEADER_BYTES + CTX.block_bytes


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    status = main(list(args))
    return status, capsys.readouterr().out


def store(root: Path, keys: list[bytes], **tier: object) -> None:
    blocks = make_blocks(len(keys), CTX.block_bytes, seed=len(keys))

    async def run() -> None:
        async with opened(FsTier("fs", CTX, 2, 2, root_dir=root, **tier)) as fs:
            assert await fs.store(keys, blocks) == [True] * len(keys)

    anyio.run(run)


def outside_dir(tmp_path: Path, key: bytes) -> tuple[Path, dict[str, bytes]]:
    """A directory outside every root holding ``*.bin`` files, one named like ``key``'s
    block, plus what each holds."""
    where = tmp_path / "outside"
    where.mkdir()
    files = {
        "firmware.bin": b"not a block" * 100,
        os.path.basename(block_relpath(CTX, key)): b"\0" * FILE,
        "notes.txt": b"keep me",
    }
    for name, data in files.items():
        (where / name).write_bytes(data)
    return where, files


def assert_untouched(where: Path, files: dict[str, bytes]) -> None:
    assert {p.name: p.read_bytes() for p in where.iterdir()} == files


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "root"
    path.mkdir(mode=0o700)
    return path


# -- the helpers themselves ------------------------------------------------------------------


def test_a_link_below_the_root_is_never_entered(root: Path, tmp_path: Path) -> None:
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "x.bin").write_bytes(b"x")
    where, files = outside_dir(tmp_path, make_keys(1)[0])
    (root / "a" / "link").symlink_to(where)
    walked = {relpath: st.st_mode for relpath, st in beneath.walk(str(root))}
    assert set(walked) == {"a/b/x.bin", "a/link"}  # the link is listed, not entered
    assert list(beneath.walk(str(root), "a/link")) == []
    with pytest.raises(beneath.LinkBelowRootError, match="a/link"):
        beneath.entries(str(root), "a/link")
    assert not beneath.unlink(str(root), "a/link/firmware.bin")
    assert beneath.unlink(str(root), "a/link")  # the link itself may go
    assert_untouched(where, files)
    with pytest.raises(ValueError, match=r"'\.\.'"):
        beneath.unlink(str(root), "a/../../outside/firmware.bin")
    with pytest.raises(ValueError, match="not below"):
        beneath.unlink_under(str(root), str(where / "firmware.bin"))


def test_unlink_with_an_identity_leaves_a_replaced_file(root: Path) -> None:
    (root / "f.bin").write_bytes(b"old")
    st = (root / "f.bin").stat()
    (root / "f.bin").rename(root / "old")  # kept: its inode is not reused
    (root / "f.bin").write_bytes(b"new")  # a peer published a good copy since
    assert not beneath.unlink(str(root), "f.bin", (st.st_dev, st.st_ino))
    assert (root / "f.bin").read_bytes() == b"new"


# -- the fs tier -----------------------------------------------------------------------------


def test_the_tier_refuses_a_rank_directory_that_is_a_link(root: Path, tmp_path: Path) -> None:
    key = make_keys(1)[0]
    where, files = outside_dir(tmp_path, key)
    (root / CTX.namespace).mkdir(mode=0o700)
    (root / CTX.namespace / "r0").symlink_to(where)
    with pytest.raises(UntrustedRootError, match="r0: a symbolic link"):
        store(root, [key], max_bytes=FILE)
    assert_untouched(where, files)


def test_the_tiers_gc_never_deletes_through_a_fan_out_link(root: Path, tmp_path: Path) -> None:
    """A fan-out directory of the rank directory is a link to an outside directory of
    ``*.bin`` files: the open's scan does not count them, and ``max_bytes`` evictions after
    an open and stores delete none of them."""
    keys = make_keys(12)
    where, files = outside_dir(tmp_path, keys[0])
    rank_dir = root / CTX.namespace / "r0"
    rank_dir.mkdir(parents=True, mode=0o700)
    (rank_dir / "fff").symlink_to(where)
    store(root, keys[:6], max_bytes=4 * FILE)  # 6 stores into room for 4: evictions
    store(root, keys[6:], max_bytes=4 * FILE)  # a new open scans, trims, stores, evicts
    assert_untouched(where, files)
    blocks = [p for p in rank_dir.rglob("*.bin") if not p.is_relative_to(rank_dir / "fff")]
    assert len(blocks) == 4


# -- kvtier gc ---------------------------------------------------------------------------------


def test_gc_never_enters_a_rank_directory_that_is_a_link(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = make_keys(3)
    store(root, keys)
    where, files = outside_dir(tmp_path, keys[0])
    (root / CTX.namespace / "r1").symlink_to(where)
    status, out = cli(capsys, "gc", str(root), "--max-bytes", "0")
    assert status == 0
    assert f"not entered (a symbolic link where a rank directory goes): {CTX.namespace}/r1" in out
    assert "deleted 3 blocks" in out
    assert_untouched(where, files)


def test_gc_of_a_namespace_whose_only_rank_is_a_link_deletes_nothing(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No real rank directory: the namespace's own temporaries are still looked at, and
    the link is not scanned in r0's place."""
    where, files = outside_dir(tmp_path, make_keys(1)[0])
    (root / CTX.namespace).mkdir(mode=0o700)
    (root / CTX.namespace / "r0").symlink_to(where)
    status, out = cli(capsys, "gc", str(root), "--max-bytes", "0", "--json")
    assert status == 0
    plan = json.loads(out)
    assert plan["deleted"] == [] and plan["links_not_entered"] == [f"{CTX.namespace}/r0"]
    assert_untouched(where, files)


def test_gc_with_a_directory_swapped_for_a_link_after_its_plan(root: Path, tmp_path: Path) -> None:
    """Between the plan and the deletions, the fan-out directory of a victim becomes a
    link to an outside directory holding a file of the victim's name: it stays."""
    keys = make_keys(4)
    store(root, keys)
    plan = fsroot.gc_plan(str(root), 0)
    assert len(plan.victims) == 4
    victim = root / plan.victims[0].relpath
    where, files = outside_dir(tmp_path, keys[0])
    shutil.copy(victim, where / victim.name)
    files[victim.name] = victim.read_bytes()
    moved = tmp_path / "moved"
    victim.parent.rename(moved)
    victim.parent.symlink_to(where)
    result = fsroot.gc_apply(plan)
    assert_untouched(where, files)
    assert (moved / victim.name).exists()  # it is not reachable below the root any more
    assert result.vanished >= 1 and len(result.deleted) == 4 - result.vanished


# -- kvtier inspect --repair ------------------------------------------------------------------


def test_repair_never_deletes_because_config_json_disagrees(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = make_keys(6)
    store(root, keys)
    config = root / CTX.namespace / "config.json"
    fields = json.loads(config.read_text())
    fields["block_bytes"] = 3 * CTX.block_bytes
    config.chmod(0o600)
    config.write_text(json.dumps(fields))
    status, out = cli(capsys, "inspect", str(root), "--verify", "--repair")
    assert status == 1
    assert "6 disagree with config.json" in out
    assert "0 damaged" in out
    assert len(list(root.rglob("*.bin"))) == 6  # every sound block is still there
    # one block really damaged beside them: still nothing deleted, and it says why
    damaged = root / block_relpath(CTX, keys[0])
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    status, out = cli(capsys, "inspect", str(root), "--verify", "--repair", "--json")
    assert status == 1
    document = json.loads(out)["verify"]
    assert document["repair_refused"] and len(document["disagree_with_config"]) == 5
    assert [d["deleted"] for d in document["damaged"]] == [False]
    assert len(list(root.rglob("*.bin"))) == 6
    # config.json put right: the repair deletes the damaged block, and only it
    fields["block_bytes"] = CTX.block_bytes
    config.write_text(json.dumps(fields))
    status, out = cli(capsys, "inspect", str(root), "--verify", "--repair")
    assert status == 0 and "repair: 1 damaged blocks deleted" in out
    assert len(list(root.rglob("*.bin"))) == 5 and not damaged.exists()
