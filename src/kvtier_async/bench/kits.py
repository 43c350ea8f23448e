"""Where the benchmarks that drive vLLM find their harnesses: the test tree's ``tests/kits``.

``kvtier bench sched`` runs vLLM's real `Scheduler` on the connector harness (``vllm_kit``:
a fake model and a fake offloading worker) and ``kvtier bench e2e`` runs whole engine
processes through the engine kit (``engine_kit``). Both are test kits, so they live in the
test tree, not in the wheel; these two benchmarks run from a source checkout, where vLLM is
installed as they need it anyway (``nox -s bench``, ``nox -s bench_e2e``). The other
benchmarks, ``bench fleet`` included, need no kit.

`load` imports a kit from ``sys.path`` when it is there (the test suite and the nox sessions
put ``tests/kits`` on it), else from the checkout this package runs from (an editable
install: ``pip install -e``), else raises `KitMissingError`, whose message says how to run
the benchmark.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Final

__all__ = ["KITS", "KitMissingError", "checkout_kits", "load"]

#: The kits, by module name, and what each is.
KITS: Final = {
    "vllm_kit": "the connector harness (vLLM's Scheduler with a fake model)",
    "engine_kit": "the engine kit (vLLM engine processes on the CPU build)",
}


class KitMissingError(RuntimeError):
    """A test kit a benchmark needs is not importable: not a source checkout."""


def checkout_kits() -> Path | None:
    """``tests/kits`` of the source checkout this package runs from, or None (a wheel)."""
    root = Path(__file__).resolve().parents[3]  # src/kvtier_async/bench/kits.py -> the root
    kits = root / "tests" / "kits"
    return kits if (kits / "vllm_kit" / "__init__.py").is_file() else None


def load(name: str) -> ModuleType:
    """Import the kit ``name`` (a key of `KITS`); `KitMissingError` if this is not a
    checkout (see the module docstring)."""
    if name not in KITS:
        raise ValueError(f"kit: {name!r} is not a kit; the kits are {sorted(KITS)}")
    if importlib.util.find_spec(name) is None:
        kits = checkout_kits()
        if kits is None:
            raise KitMissingError(
                f"needs {KITS[name]}, which lives in the source tree (tests/kits/{name}), "
                "not in the installed package: run it from a checkout of kvtier-async "
                "(nox -s bench, nox -s bench_e2e)"
            )
        sys.path.insert(0, str(kits))
    return importlib.import_module(name)
