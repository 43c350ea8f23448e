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
