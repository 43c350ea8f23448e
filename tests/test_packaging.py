"""What the package installs (issue 24, item 2): one top-level name, ``kvtier_async``.

The Triton kernels keep their folder, ``src/kernels/``, and install as
``kvtier_async.kernels`` (a top-level ``kernels`` would clash with Hugging Face's package of
that name, which transformers imports when it is present). `pyproject.toml` lists the
packages by hand for that mapping; the first test keeps the list in step with the folders,
the second builds the wheel and reads what it would install.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def _setuptools() -> dict[str, object]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    table: dict[str, object] = config["tool"]["setuptools"]
    return table


def test_the_package_list_names_every_package_folder() -> None:
    folders = {
        ".".join(init.parent.relative_to(SRC).parts)
        for init in (SRC / "kvtier_async").rglob("__init__.py")
    }
    folders |= {
        "kvtier_async.kernels" + ".".join(("", *init.parent.relative_to(SRC / "kernels").parts))
        for init in (SRC / "kernels").rglob("__init__.py")
    }
    assert set(_setuptools()["packages"]) == folders  # type: ignore[arg-type]
    assert _setuptools()["package-dir"] == {"": "src", "kvtier_async.kernels": "src/kernels"}


@pytest.mark.slow
def test_the_wheel_installs_no_top_level_name_but_kvtier_async(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("kvtier_async-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"kvtier_async"}
    assert "kvtier_async/kernels/swap_blocks.py" in names
    assert "kvtier_async/py.typed" in names


WITHOUT_S3 = """
import json, sys, tempfile
for name in ("aioboto3", "aiobotocore", "aiohttp", "botocore"):
    sys.modules[name] = None  # as if the s3 extra were not installed
import contextlib, io
from kvtier_async.api import CacheConfig
from kvtier_async.cli import main
from kvtier_async.config import ConfigError

out = {}
try:
    import anyio
    from kvtier_async.api import TieredKVCache

    async def open_obj():
        async with TieredKVCache({"block_bytes": 4096, "num_slots": 2,
                                  "secondary_tiers": [{"type": "obj", "bucket": "b"}]}):
            pass

    anyio.run(open_obj)
    out["obj"] = "opened"
except ConfigError as exc:
    out["obj"] = str(exc)
for name, argv in (("inspect_s3", ["inspect", "s3://bucket"]),
                   ("inspect_fs", ["inspect", tempfile.mkdtemp()]),
                   ("bench_s3", ["bench", "--quick", "s3"])):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = main(argv)
    out[name] = [status, err.getvalue().strip().splitlines()]
print(json.dumps(out))
"""


def test_without_the_s3_extra_each_s3_part_names_it_in_one_line() -> None:
    """The base install has no S3 stack (issue 24, item 4): the obj tier, ``kvtier inspect
    s3://`` and ``kvtier bench s3`` each stop with one line naming the extra, and the rest
    (an fs root's inspect) works."""
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_S3], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    import json

    out = json.loads(done.stdout.strip().splitlines()[-1])
    hint = "pip install 'kvtier-async[s3]'"
    assert out["obj"].startswith("secondary_tiers[0].type: tier 'obj' needs the s3 extra")
    assert hint in out["obj"]
    status, lines = out["inspect_s3"]
    assert status == 2 and len(lines) == 1 and hint in lines[0], lines
    status, lines = out["bench_s3"]  # its progress line, then the one error line
    assert status == 2 and hint in lines[-1] and not any("Traceback" in x for x in lines), lines
    assert out["inspect_fs"][0] == 0
