"""Shared test configuration.

Every ``@pytest.mark.anyio`` test runs on asyncio and on trio (`anyio_backend`); a module
whose code is asyncio-only (the S3 tier: aiobotocore) overrides the fixture.

Open task groups and cancel scopes in test bodies, not across a fixture's ``yield``:
pytest-asyncio runs fixture setup and teardown in separate tasks.
"""

from __future__ import annotations

import pytest


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)
