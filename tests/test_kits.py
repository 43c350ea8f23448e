"""`kvtier_async.bench.kits`: the benchmarks that drive vLLM find the test kits in the source
tree (``tests/kits``), and say how to run them where there is none (a wheel)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from kvtier_async.bench import kits

KITS_DIR = Path(__file__).resolve().parent / "kits"


def _without_kits(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a process that has not put ``tests/kits`` on its path or imported a kit."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p).resolve() != KITS_DIR])
    for name in list(sys.modules):
        if name.split(".")[0] in kits.KITS:
            monkeypatch.delitem(sys.modules, name)


def test_a_checkout_finds_its_kits() -> None:
    assert kits.checkout_kits() == KITS_DIR


def test_a_kit_loads_from_the_checkout_when_it_is_not_on_the_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _without_kits(monkeypatch)
    module = kits.load("engine_kit")  # imports no vLLM
    assert Path(module.__file__ or "").resolve().parent == KITS_DIR / "engine_kit"
    assert str(KITS_DIR) in sys.path


def test_without_a_checkout_the_error_says_where_the_kit_lives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _without_kits(monkeypatch)
    monkeypatch.setattr(kits, "checkout_kits", lambda: None)
    with pytest.raises(kits.KitMissingError, match=r"tests/kits/vllm_kit.*checkout"):
        kits.load("vllm_kit")


def test_an_unknown_kit_is_refused_with_the_kits_named() -> None:
    with pytest.raises(ValueError, match=r"'nope' is not a kit.*engine_kit.*vllm_kit"):
        kits.load("nope")


def test_the_package_holds_no_kit() -> None:
    package = Path(kits.__file__).resolve().parent
    assert not (package / "vllm_kit").exists()
    assert not (package / "engine_kit").exists()


def test_bench_sched_without_its_kit_says_where_it_lives_and_reports_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if importlib.util.find_spec("vllm") is None:  # found, not imported: the kit would import it
        pytest.skip("vLLM is not installed: sched stops before its kit")
    from kvtier_async.bench import sched

    _without_kits(monkeypatch)
    monkeypatch.setattr(kits, "checkout_kits", lambda: None)
    for name in ("VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM", "HF_HUB_OFFLINE"):
        # sched sets them; set, then deleted, each is put back as it was after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    said: list[str] = []
    assert sched.run(quick=True, progress=said.append) == []
    assert len(said) == 1
    assert said[0].startswith("sched: needs the connector harness")
    assert "tests/kits/vllm_kit" in said[0]
