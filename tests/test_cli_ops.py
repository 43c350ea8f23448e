"""The operations CLI (``kvtier inspect``, ``gc``, ``regions``) on real things: fs tier roots
that `FsTier` filled (then damaged with `test_tier_fs`'s helper), a moto bucket on 127.0.0.1
that `S3Tier` filled, and /dev/shm regions made by `SharedRegion` in this process and in
child processes killed with SIGKILL.

Each command runs in this process through `kvtier_async.cli.main`, its stdout, stderr and exit
status asserted, ``--json`` parsed. Child processes coordinate with events; their timeouts
only keep a broken test from hanging, they never order anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import io
import json
import mmap
import multiprocessing
import os
import shutil
import signal
import socket
import threading
import time
import uuid
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import anyio
import pytest

from _s3 import Injector, make_blocks, make_keys, opened, raw_client
from kvtier_async.bench.s3server import MotoS3Server
from kvtier_async.cli import main
from kvtier_async.memory import SharedRegion, region_path
from kvtier_async.memory.owner import OwnerRecord, write_owner
from kvtier_async.ops import fsroot, render, s3root
from kvtier_async.ops.layout import Block, lru_victims
from kvtier_async.ops.s3root import connect, parse_url
from kvtier_async.tiers.base import TierContext
from kvtier_async.tiers.blockfile import HEADER_BYTES, block_relpath
from kvtier_async.tiers.fs import FsTier, tempfiles
from kvtier_async.tiers.s3 import S3Config, S3Tier
from test_tier_fs import VERDICTS, _craft

pytest_plugins = ["conftest_s3"]

PAGE = mmap.PAGESIZE
SHM = Path("/dev/shm")
MP = multiprocessing.get_context("spawn")
WAIT_S = 60.0  # fail-safe only
CTX_A = TierContext(block_bytes=2 * PAGE, model="model-a")  # VERDICTS are for 2-page blocks
CTX_B = TierContext(block_bytes=PAGE, model="org/model-b")
FILE_A, FILE_B = HEADER_BYTES + CTX_A.block_bytes, HEADER_BYTES + CTX_B.block_bytes


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run ``kvtier ARGS`` here: (exit status, stdout, stderr)."""
    try:
        status = main(list(args))
    except SystemExit as exc:  # argparse
        status = int(exc.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


def digest(ctx: TierContext) -> str:
    return ctx.namespace.rpartition("_")[2]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "root"
    path.mkdir(mode=0o700)
    return path


def store_blocks(root: Path, ctx: TierContext, count: int, **tier: Any) -> list[bytes]:
    """``count`` new blocks stored under ``root`` by a real `FsTier`; their keys."""
    keys, blocks = make_keys(count), make_blocks(count, ctx.block_bytes, seed=count)

    async def store() -> None:
        async with opened(FsTier("fs", ctx, 4, 4, root_dir=root, **tier)) as fs:
            assert await fs.store(keys, blocks) == [True] * count

    anyio.run(store)
    return keys


def block_file(root: Path, ctx: TierContext, key: bytes) -> Path:
    return root / block_relpath(ctx, key)


def temp_name(token: str, pid: int, start: int) -> str:
    return f".{'ab' * 32}.{token}-{pid}-{start}-0.tmp"


def add_temps(directory: Path) -> dict[str, Path]:
    """A named temporary of a live writer (this process), of a dead one (this pid with
    another start time), and of another host."""
    me = tempfiles.identity()
    names = {
        "live": temp_name(me.token, me.pid, me.start),
        "dead": temp_name(me.token, me.pid, me.start + 1),
        "foreign": temp_name("0badf00d", 1, 1),
    }
    paths = {state: directory / name for state, name in names.items()}
    for path in paths.values():
        path.write_bytes(b"partial")
    return paths


def spread_mtimes(paths: list[Path], seed: int = 7) -> list[Path]:
    """Give ``paths`` distinct modification times in a shuffled order; that order."""
    order = sorted(paths, key=lambda p: hash((seed, p.name)))
    base = time.time_ns() - 10**12
    for i, path in enumerate(order):
        os.utime(path, ns=(base + i * 10**9, base + i * 10**9))
    return order


# -- inspect ---------------------------------------------------------------------------------


def test_inspect_reports_models_ranks_config_and_leftovers(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store_blocks(root, CTX_A, 5)
    store_blocks(root, dataclasses.replace(CTX_A, rank=1), 3)
    store_blocks(root, CTX_B, 2)
    ns_a = root / CTX_A.namespace
    add_temps(ns_a / "r0")
    (ns_a / "notes.txt").write_text("not a block")
    (root / "README").write_text("not a namespace")

    status, out, err = cli(capsys, "inspect", str(root))
    assert status == 0 and err == ""
    total = 8 * FILE_A + 2 * FILE_B
    lines = out.splitlines()
    assert lines[0] == f"{root}: 2 model namespaces, 10 blocks, {render.format_size(total)}"
    text = "\n".join(line.rstrip() for line in lines)
    assert f"{CTX_A.namespace}\n  model model-a  digest {digest(CTX_A)}\n" in text
    assert f"  model org/model-b  digest {digest(CTX_B)}\n" in text
    assert f"block_bytes={2 * PAGE} block_tokens=16 dtype=float16" in text
    rows = [line.split()[:2] for line in lines if line.startswith("  r") and "rank" not in line]
    assert rows == [["r0", "5"], ["r1", "3"], ["r0", "2"]]
    assert "  temporary files: 3 (1 live, 1 dead, 1 foreign)" in lines
    assert "  other files: 1" in lines and f"    {CTX_A.namespace}/notes.txt" in lines
    assert lines[-2:] == ["outside any namespace: 1 entries", "  README"]

    status, out, _ = cli(capsys, "inspect", "--json", str(root))
    assert status == 0
    report = json.loads(out)
    assert (report["kind"], report["blocks"], report["bytes"]) == ("fs", 10, total)
    a, b = report["namespaces"]  # sorted by name: model-a_..., org-model-b_...
    assert (a["namespace"], a["model"], a["digest"]) == (CTX_A.namespace, "model-a", digest(CTX_A))
    assert a["config"] == CTX_A.namespace_fields() and b["config"] == CTX_B.namespace_fields()
    assert [(r["rank"], r["blocks"], r["bytes"]) for r in a["ranks"]] == [
        (0, 5, 5 * FILE_A), (1, 3, 3 * FILE_A),
    ]  # fmt: skip
    mtimes = [p.stat().st_mtime for p in (ns_a / "r1").rglob("*.bin")]
    oldest = datetime.datetime.fromisoformat(a["ranks"][1]["oldest"]).timestamp()
    newest = datetime.datetime.fromisoformat(a["ranks"][1]["newest"]).timestamp()
    assert (oldest, newest) == pytest.approx((min(mtimes), max(mtimes)), abs=1e-5)
    assert a["temp_files"] == {"live": 1, "dead": 1, "foreign": 1, "unknown": 0}
    assert a["other_files"] == [f"{CTX_A.namespace}/notes.txt"]
    assert report["other_files"] == ["README"]


@pytest.mark.parametrize("planted", ["directory", "fifo", "dev-zero-link"])
def test_inspect_reports_a_config_json_it_cannot_trust_and_goes_on(
    root: Path, capsys: pytest.CaptureFixture[str], planted: str
) -> None:
    """Never read, never waited on (a FIFO without a writer), never crashes the report;
    --verify then judges each block by its own header."""
    store_blocks(root, CTX_A, 3)
    config = root / CTX_A.namespace / "config.json"
    config.unlink()
    if planted == "directory":
        config.mkdir(mode=0o700)
    elif planted == "fifo":
        os.mkfifo(config, 0o600)
    else:
        config.symlink_to("/dev/zero")
    for args in (["inspect"], ["inspect", "--verify"]):
        status, out, err = cli(capsys, *args, str(root))
        assert status == 0, err
        assert "config.json unreadable" in out
        assert out.startswith(f"{root}: 1 model namespace, 3 blocks")


def test_inspect_says_when_a_root_holds_no_namespace(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = cli(capsys, "inspect", str(root))
    assert status == 0
    assert out.splitlines() == [
        f"{root}: 0 model namespaces, 0 blocks, 0 B",
        "  no <model>_<digest> directories here: is this a tier's root?",
    ]


def damage_every_way(root: Path, keys: list[bytes]) -> dict[str, str]:
    """Damage one block per kind of `test_tier_fs.VERDICTS`, put a link at one more block's
    name (to a good block) and a misnamed file; ``{relpath: reason}`` expected."""
    expected = {}
    for kind, key in zip(VERDICTS, keys):
        path = block_file(root, CTX_A, key)
        path.write_bytes(_craft(kind, key, path.read_bytes()[HEADER_BYTES:]))
        expected[block_relpath(CTX_A, key)] = VERDICTS[kind]
    link, target = keys[len(VERDICTS)], keys[len(VERDICTS) + 1]
    block_file(root, CTX_A, link).unlink()
    block_file(root, CTX_A, link).symlink_to(block_file(root, CTX_A, target))
    expected[block_relpath(CTX_A, link)] = "a symbolic link or special file (not followed)"
    misnamed = f"{CTX_A.namespace}/r0/abc/de_g0/not-hex.bin"
    (root / misnamed).parent.mkdir(parents=True, exist_ok=True)
    (root / misnamed).write_bytes(b"x" * FILE_A)
    expected[misnamed] = "not named like a block file (<hex key>.bin in <hh>_g<group>)"
    return expected


def test_verify_lists_damaged_blocks_and_repair_deletes_only_them(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = store_blocks(root, CTX_A, 20)
    expected = damage_every_way(root, keys)
    blocks = 20 - 1 + 1  # the link is no block; the misnamed file is one (by its name)
    good = blocks - len(expected) + 1

    status, out, err = cli(capsys, "inspect", "--verify", str(root))
    assert status == 1  # damage found, not repaired
    found = {
        line.split(": ", 2)[1]: line.split(": ", 2)[2]
        for line in out.splitlines()
        if line.startswith("damaged: ")
    }
    assert found == expected
    assert (
        f"verify: {blocks} of {blocks} blocks checked, {good} good, {len(expected)} damaged" in out
    )
    assert "run again with --repair to delete the damaged blocks" in out
    # progress: a line per tenth on a stream that is not a terminal
    progress = err.splitlines()
    assert len(progress) == 10 and progress[-1].startswith(
        f"verify: {blocks}/{blocks} blocks (100%), "
    )
    assert all(" blocks/s, " in line and " MB/s, ETA " in line for line in progress)
    assert all(os.path.lexists(root / relpath) for relpath in expected)  # nothing deleted

    status, out, _ = cli(capsys, "inspect", "--verify", "--repair", "--json", str(root))
    assert status == 0
    verdict = json.loads(out)["verify"]
    assert {d["path"]: d["reason"] for d in verdict["damaged"]} == expected
    assert all(d["deleted"] for d in verdict["damaged"]) and verdict["good"] == good
    assert not any(os.path.lexists(root / relpath) for relpath in expected)
    assert block_file(root, CTX_A, keys[len(VERDICTS) + 1]).is_file()  # the link's target

    status, out, _ = cli(capsys, "inspect", "--verify", str(root))
    assert status == 0 and f"{good} good, 0 damaged" in out

    async def load_the_rest() -> list[bool]:  # what is left loads through the tier
        left = [k for k in keys if block_file(root, CTX_A, k).exists()]
        views = make_blocks(len(left), CTX_A.block_bytes)
        async with opened(FsTier("fs", CTX_A, 4, 4, root_dir=root)) as fs:
            return await fs.load(left, views)

    assert anyio.run(load_the_rest) == [True] * good


def test_verify_skips_blocks_that_vanish_after_the_walk(root: Path) -> None:
    keys = store_blocks(root, CTX_A, 12)
    walked = fsroot.walk(str(root))
    for key in keys[:3]:  # an instance deletes them (GC, a failed load) meanwhile
        block_file(root, CTX_A, key).unlink()
    result = fsroot.verify(str(root), walked, jobs=3)
    assert (result.checked, result.good, result.vanished) == (12, 9, 3)
    assert result.damaged == [] and result.errors == []


def test_inspect_and_gc_run_beside_an_instance_that_stores_and_evicts(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A live `FsTier` with ``max_bytes`` stores new blocks and deletes old ones while the
    commands walk, read and delete: files come and go under them, nothing is damaged."""
    started, stop = threading.Event(), threading.Event()
    stored: list[int] = [0]
    failures: list[BaseException] = []

    async def instance() -> None:
        async with opened(FsTier("live", CTX_A, 4, 4, root_dir=root, max_bytes=40 * FILE_A)) as fs:
            while not stop.is_set():
                keys, blocks = make_keys(8), make_blocks(8, CTX_A.block_bytes)
                assert await fs.store(keys, blocks) == [True] * 8
                stored[0] += 8
                if stored[0] >= 48:
                    started.set()  # the limit was reached: it evicts from now on

    def run() -> None:
        try:
            anyio.run(instance)
        except BaseException as exc:
            failures.append(exc)
            started.set()

    writer = threading.Thread(target=run)
    writer.start()
    try:
        assert started.wait(WAIT_S) and not failures
        for _ in range(3):
            status, out, err = cli(capsys, "inspect", "--verify", str(root))
            assert status == 0, out + err
            assert " 0 damaged, " in out and " 0 unreadable;" in out
            status, out, err = cli(capsys, "gc", str(root), "--max-bytes", f"{20 * FILE_A}")
            assert status == 0 and "could not delete" not in out, out + err
    finally:
        stop.set()
        writer.join(WAIT_S)
    assert not failures and stored[0] > 48


# -- gc --------------------------------------------------------------------------------------


def test_gc_evicts_in_the_tiers_own_order(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Differential: gc leaves exactly what the fs tier's own max_bytes GC leaves of a copy
    of the same root (its open trims the root it scans)."""
    keys = store_blocks(root, CTX_A, 20)
    order = spread_mtimes([block_file(root, CTX_A, key) for key in keys])
    twin = tmp_path / "twin"
    shutil.copytree(root, twin, copy_function=shutil.copy2)  # mtimes too
    limit = 7 * FILE_A + FILE_A // 2

    status, out, _ = cli(capsys, "gc", str(root), "--max-bytes", str(limit), "--dry-run", "--json")
    assert status == 0
    plan = json.loads(out)
    assert plan["dry_run"] and (plan["blocks"], plan["bytes"]) == (20, 20 * FILE_A)
    assert [v["path"] for v in plan["would_delete"]] == [
        str(p.relative_to(root)) for p in order[:13]
    ]  # least recently used first
    assert plan["freed_bytes"] == 13 * FILE_A
    assert len(list(root.rglob("*.bin"))) == 20  # a dry run deletes nothing

    status, out, _ = cli(capsys, "gc", "-v", str(root), "--max-bytes", str(limit))
    assert status == 0
    lines = out.splitlines()
    assert (
        lines[1]
        == f"deleted 13 blocks ({render.format_size(13 * FILE_A)}), least recently used first:"
    )
    assert len(lines) == 1 + 1 + 13 + 1  # -v lists each block
    assert lines[-1] == f"left 7 blocks, {render.format_size(7 * FILE_A)}"

    async def tier_gc() -> None:
        async with opened(FsTier("fs", CTX_A, 4, 4, root_dir=twin, max_bytes=limit)):
            pass

    anyio.run(tier_gc)
    ours = {str(p.relative_to(root)) for p in root.rglob("*.bin")}
    theirs = {str(p.relative_to(twin)) for p in twin.rglob("*.bin")}
    assert ours == theirs == {str(p.relative_to(root)) for p in order[13:]}


def test_gc_prints_a_summary_unless_asked_for_the_list(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without -v a gc says how many blocks it deleted, from when to when, in one line
    (a real root has thousands); with it, each one."""
    store_blocks(root, CTX_A, 30)
    status, out, _ = cli(capsys, "gc", str(root), "--max-bytes", "0", "--dry-run")
    assert status == 0 and len(out.splitlines()) == 3, out
    assert f"would delete 30 blocks ({render.format_size(30 * FILE_A)})" in out
    assert out.splitlines()[1].endswith("(-v lists them)")
    status, out, _ = cli(capsys, "gc", "-v", str(root), "--max-bytes", "0", "--dry-run")
    assert status == 0 and len(out.splitlines()) == 3 + 30


def test_gc_of_one_model_and_down_to_nothing(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store_blocks(root, CTX_A, 4)
    store_blocks(root, CTX_B, 3)
    status, out, _ = cli(capsys, "gc", str(root), "--max-bytes", "0", "--model", digest(CTX_B))
    assert status == 0
    assert out.splitlines()[0] == (
        f"{root} ({CTX_B.namespace}): 3 blocks, {render.format_size(3 * FILE_B)}; limit 0 B"
    )
    assert not list((root / CTX_B.namespace).rglob("*.bin"))
    assert len(list((root / CTX_A.namespace).rglob("*.bin"))) == 4
    status, out, _ = cli(capsys, "gc", str(root), "--max-bytes", "1G", "--model", CTX_A.namespace)
    assert status == 0 and "nothing to delete: under the limit" in out
    status, _, err = cli(capsys, "gc", str(root), "--max-bytes", "1G", "--model", "0123456789ab")
    assert status == 2
    assert err == (
        f"kvtier gc: --model 0123456789ab: no namespace with that digest in {root} "
        f"(there: {CTX_A.namespace}, {CTX_B.namespace})\n"
    )


def test_gc_removes_temporaries_of_dead_writers_only(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store_blocks(root, CTX_A, 2)
    temps = add_temps(root / CTX_A.namespace / "r0")
    status, out, _ = cli(capsys, "gc", str(root), "--max-bytes", "1T", "--dry-run", "-v")
    assert status == 0 and all(path.exists() for path in temps.values())
    dead = str(temps["dead"].relative_to(root))
    assert f"would delete 1 temporary files of dead writers:\n  {dead}\n" in out
    assert "left alone: 2 temporary files of live or other-host writers" in out
    status, out, _ = cli(capsys, "-v", "gc", str(root), "--max-bytes", "1T")
    assert status == 0 and f"deleted 1 temporary files of dead writers:\n  {dead}\n" in out
    assert not temps["dead"].exists() and temps["live"].exists() and temps["foreign"].exists()
    assert len(list(root.rglob("*.bin"))) == 2


def test_lru_victims_keeps_the_tiers_tie_order() -> None:
    """Equal mtimes: by name, as `records.Usage.seed` sorts; nothing under the limit."""
    blocks = [Block(name, 0, 10, 5) for name in ("c", "a", "b")]
    assert [b.relpath for b in lru_victims(blocks, 15)] == ["a", "b"]
    assert lru_victims(blocks, 30) == []
    assert [b.relpath for b in lru_victims(blocks, 0)] == ["a", "b", "c"]


@pytest.mark.parametrize(
    ("text", "value"),
    [("0", 0), ("4096", 4096), ("512M", 512 << 20), ("10G", 10 << 30), ("1T", 1 << 40),
     ("10g", 10 << 30), ("1.5K", 1536), ("2GiB", 2 << 30), ("3kb", 3072)],
)  # fmt: skip
def test_sizes_take_powers_of_1024(text: str, value: int) -> None:
    assert render.parse_size(text) == value


@pytest.mark.parametrize("text", ["", "-1", "10X", "G", "1e3", "ten"])
def test_a_bad_size_names_the_flag(
    root: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    status, out, err = cli(capsys, "gc", str(root), "--max-bytes", text)
    assert status == 2 and out == ""
    assert (
        f"argument --max-bytes: expected a byte count such as 1073741824, 512M, 10G or 1T "
        f"(powers of 1024), got {text!r}" in err
    )


# -- errors ----------------------------------------------------------------------------------


def test_bad_paths_and_urls_exit_2_saying_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing, a_file = tmp_path / "missing", tmp_path / "file"
    a_file.write_text("x")
    cases = [
        (["inspect", str(missing)], f"kvtier inspect: {missing}: no such directory"),
        (["inspect", str(a_file)], f"kvtier inspect: {a_file}: not a directory"),
        (["gc", str(missing), "--max-bytes", "1G"], f"kvtier gc: {missing}: no such directory"),
        (["regions", "--dir", str(missing)], f"kvtier regions: {missing}: no such directory"),
        (["inspect", "s3:/bucket"], "kvtier inspect: 's3:/bucket': expected s3://BUCKET or "
         "s3://BUCKET/PREFIX"),
        (["gc", "s3://", "--max-bytes", "1"], "kvtier gc: 's3://': expected s3://BUCKET or "
         "s3://BUCKET/PREFIX"),
        (["inspect", "s3://b", "--endpoint", "ftp://h:1"], "kvtier inspect: --endpoint: scheme "
         "must be http or https, got 'ftp'"),
    ]  # fmt: skip
    for args, message in cases:
        status, out, err = cli(capsys, *args)
        assert (status, out, err) == (2, "", message + "\n"), args
    status, _, err = cli(capsys, "gc", str(tmp_path))
    assert status == 2 and "the following arguments are required: --max-bytes" in err


# -- a bucket --------------------------------------------------------------------------------


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Credentials from the environment (the AWS chain), as the README says."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", MotoS3Server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", MotoS3Server.secret_key)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.delenv("AWS_PROFILE", raising=False)


def s3_store(server: MotoS3Server, bucket: str, ctx: TierContext, count: int) -> list[bytes]:
    """``count`` new blocks stored under prefix ``kv`` by a real `S3Tier`; their keys."""
    keys, blocks = make_keys(count), make_blocks(count, ctx.block_bytes, seed=count)
    config = S3Config.parse(server.tier_config(bucket, prefix="kv"), "obj")

    async def store() -> None:
        async with opened(S3Tier("obj", ctx, config)) as tier:
            assert await tier.store(keys, blocks) == [True] * count

    anyio.run(store, backend="asyncio")
    return keys


def s3_call(server: MotoS3Server, method: str, **kwargs: Any) -> Any:
    async def call() -> Any:
        async with raw_client(server) as client:
            answer = await getattr(client, method)(**kwargs)
            if "Body" in answer:
                answer["Data"] = await answer["Body"].read()
            return answer

    return anyio.run(call, backend="asyncio")


def s3_listing(server: MotoS3Server, bucket: str) -> list[dict[str, Any]]:
    return list(s3_call(server, "list_objects_v2", Bucket=bucket).get("Contents", []))


def sync_root(server: MotoS3Server, bucket: str, root: Path) -> None:
    """Upload every file under ``root`` as ``kv/<relative path>`` (an fs root synced)."""
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        name = f"kv/{path.relative_to(root)}"
        s3_call(server, "put_object", Bucket=bucket, Key=name, Body=path.read_bytes())


@pytest.mark.usefixtures("aws_env")
def test_inspect_a_bucket_and_its_synced_config(
    moto_s3: MotoS3Server, s3_bucket: str, root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s3_store(moto_s3, s3_bucket, CTX_B, 5)
    store_blocks(root, CTX_A, 3)
    sync_root(moto_s3, s3_bucket, root)
    url, endpoint = f"s3://{s3_bucket}/kv", moto_s3.endpoint

    status, out, err = cli(capsys, "inspect", url, "--endpoint", endpoint)
    assert status == 0 and err == ""
    lines = out.splitlines()
    total = 3 * FILE_A + 5 * FILE_B
    assert lines[0] == f"{url}: 2 model namespaces, 8 blocks, {render.format_size(total)}"
    assert (
        "  config: no config.json object (the obj tier writes none; a root synced from an fs "
        "tier has one)" in lines
    )
    assert f"block_bytes={2 * PAGE} block_tokens=16" in out
    status, out, _ = cli(capsys, "inspect", url, "--endpoint", endpoint, "--json")
    report = json.loads(out)
    assert (report["kind"], report["blocks"], report["bytes"]) == ("s3", 8, total)
    a, b = report["namespaces"]
    assert a["config"] == CTX_A.namespace_fields() and b["config"] is None
    assert [(r["rank"], r["blocks"]) for r in b["ranks"]] == [(0, 5)]
    stamps = [o["LastModified"].timestamp() for o in s3_listing(moto_s3, s3_bucket)]
    newest = datetime.datetime.fromisoformat(a["ranks"][0]["newest"]).timestamp()
    assert min(stamps) <= newest <= max(stamps)


@pytest.mark.usefixtures("aws_env")
def test_a_listing_is_read_page_by_page(moto_s3: MotoS3Server, s3_bucket: str) -> None:
    s3_store(moto_s3, s3_bucket, CTX_B, 7)

    async def walk(page_size: int) -> list[str]:
        async with connect(parse_url(f"s3://{s3_bucket}/kv"), endpoint=moto_s3.endpoint) as bucket:
            bucket.page_size = page_size
            root = await bucket.walk()
        return [block.relpath for ns in root.namespaces.values() for block in ns.blocks]

    paged = anyio.run(walk, 2, backend="asyncio")
    assert len(paged) == 7 and paged == anyio.run(walk, 1000, backend="asyncio")


@pytest.mark.usefixtures("aws_env")
def test_verify_a_bucket_lists_damage_and_repair_deletes_it(
    moto_s3: MotoS3Server, s3_bucket: str, root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys_a = store_blocks(root, CTX_A, 9)
    sync_root(moto_s3, s3_bucket, root)  # with config.json: block_bytes is known
    keys_b = s3_store(moto_s3, s3_bucket, CTX_B, 4)  # the obj tier's: no config.json
    expected = {}
    for kind, key in zip(VERDICTS, keys_a):
        relpath = block_relpath(CTX_A, key)
        payload = block_file(root, CTX_A, key).read_bytes()[HEADER_BYTES:]
        s3_call(moto_s3, "put_object", Bucket=s3_bucket, Key=f"kv/{relpath}",
                Body=_craft(kind, key, payload))  # fmt: skip
        expected[relpath] = VERDICTS[kind]
    relpath_b = block_relpath(CTX_B, keys_b[0])
    body = bytearray(
        s3_call(moto_s3, "get_object", Bucket=s3_bucket, Key=f"kv/{relpath_b}")["Data"]
    )
    body[-1] ^= 0x80
    s3_call(moto_s3, "put_object", Bucket=s3_bucket, Key=f"kv/{relpath_b}", Body=bytes(body))
    expected[relpath_b] = "payload checksum mismatch"
    url, endpoint = f"s3://{s3_bucket}/kv", moto_s3.endpoint

    status, out, err = cli(capsys, "inspect", url, "--endpoint", endpoint, "--verify")
    assert status == 1
    found = {
        line.split(": ", 2)[1]: line.split(": ", 2)[2]
        for line in out.splitlines()
        if line.startswith("damaged: ")
    }
    assert found == expected
    assert "verify: 13 of 13 blocks checked, 5 good, 8 damaged, 0 vanished" in out
    assert err.splitlines()[-1].startswith("verify: 13/13 blocks (100%), ")

    status, out, _ = cli(capsys, "inspect", url, "--endpoint", endpoint, "--verify", "--repair")
    assert status == 0 and "repair: 8 damaged blocks deleted" in out
    left = {o["Key"].removeprefix("kv/") for o in s3_listing(moto_s3, s3_bucket)}
    assert not left & set(expected) and len(left) == 13 - 8 + 1  # + config.json
    status, out, _ = cli(capsys, "inspect", url, "--endpoint", endpoint, "--verify")
    assert status == 0 and "5 good, 0 damaged" in out


@pytest.mark.usefixtures("aws_env")
def test_gc_a_bucket_least_recently_modified_first(
    moto_s3: MotoS3Server, s3_bucket: str, capsys: pytest.CaptureFixture[str]
) -> None:
    s3_store(moto_s3, s3_bucket, CTX_B, 6)
    s3_store(moto_s3, s3_bucket, CTX_B, 6)
    listing = s3_listing(moto_s3, s3_bucket)
    order = [o["Key"].removeprefix("kv/") for o in sorted(
        listing, key=lambda o: (o["LastModified"], o["Key"]))]  # fmt: skip
    url, endpoint = f"s3://{s3_bucket}/kv", moto_s3.endpoint
    limit = 5 * FILE_B

    status, out, _ = cli(capsys, "gc", url, "--endpoint", endpoint, "--max-bytes", str(limit),
                         "--dry-run", "--json")  # fmt: skip
    assert status == 0
    plan = json.loads(out)
    assert [v["path"] for v in plan["would_delete"]] == order[:7]
    assert len(s3_listing(moto_s3, s3_bucket)) == 12
    status, out, _ = cli(capsys, "gc", url, "--endpoint", endpoint, "--max-bytes", str(limit))
    assert status == 0 and out.splitlines()[-1] == f"left 5 blocks, {render.format_size(limit)}"
    assert sorted(o["Key"].removeprefix("kv/") for o in s3_listing(moto_s3, s3_bucket)) == sorted(
        order[7:]
    )


@pytest.mark.usefixtures("aws_env")
def test_a_bucket_that_cannot_be_used_says_why(
    moto_s3: MotoS3Server, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    status, out, err = cli(
        capsys, "inspect", "s3://no-such-bucket/kv", "--endpoint", moto_s3.endpoint
    )
    assert (status, out) == (2, "")
    assert err == (
        f"kvtier inspect: s3://no-such-bucket/kv: bucket 'no-such-bucket' at {moto_s3.endpoint} "
        "does not exist; create it first\n"
    )
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.monotonic()
    status, out, err = cli(capsys, "inspect", "s3://b-b-b", "--endpoint", f"127.0.0.1:{port}",
                           "--timeout", "0.5")  # fmt: skip
    assert (status, out) == (1, "") and time.monotonic() - started < 10
    assert f"cannot reach http://127.0.0.1:{port}" in err and "check --endpoint" in err
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    status, out, err = cli(capsys, "gc", "s3://b-b-b", "--endpoint", moto_s3.endpoint,
                           "--max-bytes", "1G")  # fmt: skip
    assert (status, out) == (1, "")
    assert err.startswith(
        "kvtier gc: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY are empty and the AWS "
        "credential chain found none"
    )


@pytest.mark.usefixtures("aws_env")
def test_a_listing_refused_after_the_probe_exits_1_naming_the_error(
    moto_s3: MotoS3Server,
    s3_bucket: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bucket answers HEAD, then refuses the listing (an error answer injected through
    botocore's ``before-send`` event, as the obj tier's tests do)."""
    refuse = Injector(403, "AccessDenied", count=10)
    enter_client = s3root.enter_client

    async def refusing_lists(stack: Any, requests: Any) -> Any:
        client = await enter_client(stack, requests)
        client.meta.events.register("before-send.s3.ListObjectsV2", refuse)
        return client

    monkeypatch.setattr(s3root, "enter_client", refusing_lists)
    status, out, err = cli(capsys, "inspect", f"s3://{s3_bucket}", "--endpoint", moto_s3.endpoint)
    assert (status, out, refuse.injected) == (1, "", 1)  # a final answer: not retried
    assert err == (
        "kvtier inspect: ClientError: An error occurred (AccessDenied) when calling the "
        "ListObjectsV2 operation: injected AccessDenied\n"
    )


# -- the progress line -----------------------------------------------------------------------


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_redraws_one_line_at_most_every_redraw_s() -> None:
    now = [100.0]
    stream = Terminal()
    bar = render.Progress("verify", 100, 100 * 10**6, stream, clock=lambda: now[0])
    for _ in range(50):
        now[0] += render.REDRAW_S / 4 + 1e-9  # four blocks per redraw interval
        bar(1, 10**6)
    bar.finish()
    frames = stream.getvalue().split("\r")[1:]
    assert len(frames) == 50 // 4 + 1 and stream.getvalue().endswith("\x1b[K\n")
    # 50 of 100 blocks in 2.5 s: 20 blocks/s, 20 MB/s, 2.5 s to go
    assert frames[-1] == "verify: 50/100 blocks (50%), 20 blocks/s, 20.0 MB/s, ETA 0:03\x1b[K\n"


def test_progress_in_a_log_writes_a_line_per_tenth() -> None:
    now = [0.0]
    stream = io.StringIO()
    bar = render.Progress("verify", 25, 25 * 4096, stream, clock=lambda: now[0])
    for _ in range(25):
        now[0] += 0.5
        bar(1, 4096)
    bar.finish()
    lines = stream.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == [
        "3/25", "5/25", "8/25", "10/25", "13/25", "15/25", "18/25", "20/25", "23/25", "25/25",
    ]  # fmt: skip
    assert lines[0] == "verify: 3/25 blocks (12%), 2 blocks/s, 0.0 MB/s, ETA 0:11"
    assert lines[-1].endswith("ETA 0:00")


# -- regions ---------------------------------------------------------------------------------


def _region_holder(iid: str, directory: str, rank: int, ready: Event, release: Event) -> None:
    """Create (rank 0) or join (rank 1) region ``iid`` of 2 workers, then wait for
    ``release`` (one event each: killing a waiter breaks a shared one)."""
    with SharedRegion(iid, 3, 100, num_workers=2, worker_rank=rank, directory=directory):
        ready.set()
        release.wait(WAIT_S)


def test_regions_shows_owners_and_mappers_and_removes_only_dead_unmapped_ones(
    shm_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVTIER_REGION_REAPER", "0")  # a killed creator's region stays
    procs: list[tuple[Any, Event]] = []

    def start(iid: str, rank: int) -> Any:
        ready, release = MP.Event(), MP.Event()
        proc = MP.Process(target=_region_holder, args=(iid, str(shm_dir), rank, ready, release))
        proc.start()
        procs.append((proc, release))
        assert ready.wait(WAIT_S)
        return proc

    live = SharedRegion("live", 4, PAGE, directory=shm_dir)  # first: a creator sweeps
    try:
        creator = start("mapped", 0)
        peer = start("mapped", 1)  # a peer that outlives its creator
        for proc in (creator, start("dead", 0)):
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(WAIT_S)
        foreign = region_path(shm_dir, "foreign")  # a creator in another pid namespace
        foreign.write_bytes(bytes(PAGE))
        foreign.chmod(0o600)
        record = OwnerRecord(1, 1, "pid:[1]", foreign.stat().st_ino, 1, 1, PAGE)
        write_owner(foreign.with_name(foreign.name + ".owner"), record)
        (shm_dir / "unrelated.mmap").write_bytes(b"x")

        status, out, err = cli(capsys, "regions", "--dir", str(shm_dir), "--json")
        assert status == 0 and err == ""
        report = {r["instance_id"]: r for r in json.loads(out)["regions"]}
        assert sorted(report) == ["dead", "foreign", "live", "mapped"]
        state = {iid: (r["owner"], r["mapped"], r["stale"]) for iid, r in report.items()}
        assert state == {
            "live": ("alive", True, False),
            "mapped": ("dead", True, True),
            "dead": ("dead", False, True),
            "foreign": ("foreign", False, False),
        }
        assert report["live"]["pid"] == os.getpid()
        assert (report["mapped"]["pid"], report["mapped"]["num_workers"]) == (creator.pid, 2)
        assert (report["live"]["num_slots"], report["live"]["row_bytes"]) == (4, PAGE)
        assert report["live"]["size"] == 4 * PAGE and report["live"]["mode"] == "0600"
        started = datetime.datetime.fromisoformat(report["live"]["started"]).timestamp()
        assert started <= time.time() and started > time.time() - 3600

        status, out, _ = cli(capsys, "regions", "--dir", str(shm_dir))
        assert status == 0
        assert f"  live  {render.format_size(4 * PAGE)}  4 slots x 1 workers, 4.0 KiB rows" in out
        assert f"    owner: pid {os.getpid()} alive, started " in out
        assert f"    owner: pid {creator.pid} dead, started " in out
        assert "    owner: pid 1 in another pid namespace; mapped: no\n" in out
        assert out.count("; STALE") == 2
        assert "2 stale: kvtier regions --remove-stale deletes those nobody maps" in out

        status, out, _ = cli(capsys, "regions", "--dir", str(shm_dir), "--remove-stale")
        assert status == 1  # one stale region is still mapped: left
        assert f"removed: {region_path(shm_dir, 'dead')}" in out
        assert (
            f"kept (stale, but a live process still maps it): {region_path(shm_dir, 'mapped')}"
            in out
        )
        assert sorted(p.name for p in shm_dir.glob("kvtier_*.mmap")) == [
            "kvtier_foreign.mmap", "kvtier_live.mmap", "kvtier_mapped.mmap",
        ]  # fmt: skip
        procs[1][1].set()  # the peer unmaps: now it can go
        peer.join(WAIT_S)
        assert peer.exitcode == 0
        status, out, _ = cli(capsys, "regions", "--dir", str(shm_dir), "--remove-stale", "--json")
        assert status == 0
        assert json.loads(out)["removed"] == [str(region_path(shm_dir, "mapped"))]
        assert live.path.exists()
    finally:
        for proc, release in procs:
            if proc.is_alive():  # never set the event of a killed waiter: it would hang
                release.set()
                proc.join(WAIT_S)
            if proc.is_alive():
                proc.kill()
            proc.join()
        with contextlib.suppress(Exception):
            live.close()


def test_regions_in_an_empty_directory(shm_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = cli(capsys, "regions", "--dir", str(shm_dir))
    assert (status, out, err) == (0, f"{shm_dir}: no kvtier regions\n", "")


def test_uuid_instance_ids_are_listed(shm_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    iid = str(uuid.uuid4())  # what the api uses by default
    with SharedRegion(iid, 1, 8, directory=shm_dir):
        status, out, _ = cli(capsys, "regions", "--dir", str(shm_dir), "--json")
    assert status == 0 and [r["instance_id"] for r in json.loads(out)["regions"]] == [iid]
