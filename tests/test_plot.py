"""``kvtier bench --plot``: the figures a run's records make (matplotlib, the plot extra)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvtier_async.bench.report import latency_record, throughput_record

plot = pytest.importorskip("kvtier_async.bench.plot")
pytest.importorskip("matplotlib")

PNG = b"\x89PNG\r\n\x1a\n"


def test_one_figure_per_bench_plus_fs_sizes_and_distributions(tmp_path: Path) -> None:
    fs = [
        throughput_record("fs", f"{way} {size}", "GB/s", 2.0, reference=1.8, target=0.9)
        for way in ("store", "load")
        for size in ("256KiB", "2MiB")
    ] + [latency_record("fs", "store 256KiB CPU", "core-s/GB", 0.4, reference=0.6)]
    step = latency_record("sched", "lru", "step time", 300.0, reference=600.0, unit="us")
    step = replace(step, samples=(250.0, 300.0, 900.0), reference_samples=(500.0, 600.0, 1e3))
    written = plot.write_plots([*fs, step], str(tmp_path / "out"))
    names = sorted(Path(p).name for p in written)
    assert names == ["fs-by-size.png", "fs.png", "sched-distribution.png", "sched.png"]
    for path in written:
        assert Path(path).read_bytes()[:8] == PNG
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o700


def test_records_without_references_make_no_ratio_figure(tmp_path: Path) -> None:
    alone = throughput_record("engine", "x", "jobs_per_s", 10.0)
    assert plot.write_plots([alone], str(tmp_path)) == []


def test_without_matplotlib_the_error_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: object, **kwargs: object) -> object:
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(plot.PlotUnavailableError, match=r"kvtier-async\[plot\]"):
        plot.write_plots([throughput_record("a", "b", "c", 1.0, reference=1.0)], str(tmp_path))
