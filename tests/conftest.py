"""Shared test configuration.

Every ``@pytest.mark.anyio`` test runs on asyncio and on trio (`anyio_backend`); a module
whose code is asyncio-only (the S3 tier: aiobotocore) overrides the fixture.

Open task groups and cancel scopes in test bodies, not across a fixture's ``yield``:
pytest-asyncio runs fixture setup and teardown in separate tasks.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A private directory in /dev/shm (tmpfs, where CPU regions live by default and the only
    place beside hugetlbfs where Linux 6.x lets CUDA pin a file-backed region)."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("needs /dev/shm")
    path = Path(tempfile.mkdtemp(prefix="kvtier-test-", dir=shm))
    yield path
    shutil.rmtree(path, ignore_errors=True)
