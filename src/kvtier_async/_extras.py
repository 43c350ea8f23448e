"""Optional parts of the package and the extras that install them.

The base install is the CPU and fs tiers, the ledger and the engine. The obj tier's S3 stack
(``[s3]``), the benchmarks' references (``[bench]``), Prometheus series (``[metrics]``) and
the rest come with extras; what needs one that is missing stops with one line that names it
(`MissingExtraError`), checked with ``importlib.util.find_spec`` before anything is imported.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Final

__all__ = ["BENCH_S3", "FLEET", "S3", "MissingExtraError", "missing", "require"]

# What each extra brings that the code imports (the distributions' top-level modules).
S3: Final = ("aioboto3", "aiobotocore", "aiohttp", "botocore")
FLEET: Final = ("zmq", "msgspec", "aiohttp")  # kvtier_async.fleet
BENCH_S3: Final = ("moto", "flask", "flask_cors", "werkzeug")  # moto[server]


class MissingExtraError(ImportError):
    """A part of the package needs an extra that is not installed."""


def missing(modules: Sequence[str]) -> list[str]:
    """Those of ``modules`` that cannot be imported here."""
    return [name for name in modules if importlib.util.find_spec(name) is None]


def require(extra: str, modules: Sequence[str], what: str) -> None:
    """`MissingExtraError` naming ``extra`` unless every one of ``modules`` is there."""
    absent = missing(modules)
    if absent:
        raise MissingExtraError(
            f"{what} needs the {extra} extra (missing: {', '.join(absent)}): "
            f"pip install 'kvtier-async[{extra}]'"
        )
