"""Fixtures of the e2e suite: real vLLM engines on vLLM's CPU build (``nox -s e2e``).

Each engine is a process of its own (the engine kit: `engine_kit`, in ``tests/kits``),
started once per configuration for the whole session: a fixture runs one engine through
every step its tests check, and each test asserts one property of the result, so a test
costs no engine start of its own. Hits are counted with vLLM's own numbers
(``num_cached_tokens``, the prefix-cache and external-prefix-cache counters), never ours.

The model is built locally (`build_tiny_model`), in ``$KVTIER_E2E_MODEL`` when set (nox keeps
it in its folder between runs), else in a temporary directory. The S3 endpoint is moto's
server on 127.0.0.1, in a child process; engines reach it with the standard AWS credential
variables, as a user's would.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _e2e import ENGINE, PROMPTS, generate

from engine_kit import run_engine
from kvtier_async.bench.s3server import MotoS3Server


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model directory, built as a user builds it (``kvtier tiny-model``), in a process
    of its own (transformers' import warnings are not this suite's errors)."""
    where = os.environ.get("KVTIER_E2E_MODEL") or tmp_path_factory.mktemp("model")
    command = [str(Path(sys.executable).parent / "kvtier"), "tiny-model", str(where)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return Path(done.stdout.strip().splitlines()[-1]).resolve()


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="session")
def moto() -> Iterator[MotoS3Server]:
    with MotoS3Server(in_process=False) as server:
        yield server


@pytest.fixture(scope="session")
def s3_env(moto: MotoS3Server) -> dict[str, str]:
    """The environment an engine reads its S3 credentials from (AWS's standard chain)."""
    return {
        **os.environ,
        "AWS_ACCESS_KEY_ID": moto.access_key,
        "AWS_SECRET_ACCESS_KEY": moto.secret_key,
        "AWS_DEFAULT_REGION": moto.region,
    }


@pytest.fixture(scope="session")
def bucket(moto: MotoS3Server) -> str:
    name = f"kvtier-e2e-{uuid.uuid4().hex[:8]}"
    moto.create_bucket(name)
    return name


@pytest.fixture(scope="session")
def engine(tiny_model: Path, workdir: Path):  # type: ignore[no-untyped-def]
    """``engine(name, ops, kv_transfer_config=None, multiprocess=False, **engine_args)``:
    one engine process's results."""

    def run(
        name: str,
        ops: list[dict[str, Any]],
        kv_transfer_config: dict[str, Any] | None = None,
        *,
        multiprocess: bool = False,
        env: dict[str, str] | None = None,
        **engine_args: Any,
    ) -> dict[str, Any]:
        spec = {
            "model": str(tiny_model),
            "engine": {**ENGINE, **engine_args},
            "kv_transfer_config": kv_transfer_config,
            "ops": ops,
        }
        return run_engine(
            spec, workdir=workdir, multiprocess=multiprocess, name=name, env=env, timeout_s=900
        )

    return run


@pytest.fixture(scope="session")
def baseline(engine: Any) -> dict[str, list[list[int]]]:
    """Every prompt set's greedy outputs without a connector."""
    ops = [generate(name, metrics=False) for name in PROMPTS]
    results = engine("baseline", ops)["results"]
    return {name: result["token_ids"] for name, result in zip(PROMPTS, results)}
