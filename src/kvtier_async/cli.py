"""The ``kvtier`` command: ``bench``, ``demo`` and ``version``.

This is the only place that configures log output: `configure_logging` sends the library's
``logging`` records to stderr, rendered by structlog's console renderer: warnings and errors
by default, INFO with ``-v``, DEBUG with ``-vv``. Results go to stdout; progress notes go to
stderr.

Exit status: 0 on success, 1 when ``bench --check`` finds a missed target or a command fails,
2 on a usage error.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from collections.abc import Sequence

import structlog

from kvtier_async import __version__, bench
from kvtier_async.bench.report import BenchRecord, as_quick, misses, render_table

__all__ = ["configure_logging", "main", "print_records", "run_benchmarks"]

_DESCRIPTION = "kvtier-async: a three-tier KV cache (GPU -> CPU -> files / S3)."


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line *argv* (default ``sys.argv[1:]``); return the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if getattr(args, "check", False) and args.quick:
        parser.error("--check judges targets, which a --quick run cannot: drop one of them")
    handler = configure_logging(args.verbose)
    try:
        status: int = args.command(args)
        return status
    finally:
        logging.getLogger().removeHandler(handler)


def configure_logging(verbose: int) -> logging.Handler:
    """Render ``kvtier_async`` log records to stderr: WARNING and above, INFO too if
    *verbose* is 1, DEBUG too from 2.

    Returns the handler added to the root logger, so a caller can remove it again.
    """
    formatter = structlog.stdlib.ProcessorFormatter(
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()),
        ],
        foreign_pre_chain=[
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.TimeStamper(fmt="%H:%M:%S"),
        ],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    logging.getLogger().addHandler(handler)
    levels = (logging.WARNING, logging.INFO, logging.DEBUG)
    logging.getLogger("kvtier_async").setLevel(levels[min(max(verbose, 0), 2)])
    return handler


def _parser() -> argparse.ArgumentParser:
    """The argument parser: one subcommand per action, each storing its function."""
    parser = argparse.ArgumentParser(prog="kvtier", description=_DESCRIPTION)
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="log INFO lines (-vv: DEBUG too); by default only warnings and errors",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")
    run = commands.add_parser("bench", help="run benchmarks (all if no NAME is given)")
    run.add_argument("names", nargs="*", type=_bench_name, metavar="NAME", help=_names_help())
    run.add_argument("--json", action="store_true", help="print one JSON object per line")
    run.add_argument(
        "--quick", action="store_true", help="a short smoke run: figures, but no verdicts"
    )
    run.add_argument(
        "--check", action="store_true", help="exit 1 if a full run misses any target (scripts)"
    )
    run.add_argument("--plot", metavar="DIR", help="write PNG figures there (needs matplotlib)")
    run.set_defaults(command=_bench)
    show = commands.add_parser("demo", help="a simulated multi-turn chat through the tiers")
    show.add_argument("--conversations", type=_positive, default=24, help="default 24")
    show.add_argument("--turns", type=_positive, default=5, help="turns each, default 5")
    show.set_defaults(command=_demo)
    commands.add_parser("version", help="print the version").set_defaults(command=_version)
    return parser


def _positive(text: str) -> int:
    """Argparse type: a positive integer."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _names_help() -> str:
    """Help text for ``bench NAME``, listing the registered benchmarks."""
    return f"benchmark to run, one of: {', '.join(bench.BENCHMARKS)}"


def _bench_name(name: str) -> str:
    """Argparse type of a benchmark name: unknown names are a usage error (exit 2)."""
    if name not in bench.BENCHMARKS:
        valid = ", ".join(bench.BENCHMARKS)
        raise argparse.ArgumentTypeError(f"unknown benchmark {name!r}; valid names: {valid}")
    return name


def _bench(args: argparse.Namespace) -> int:
    """``kvtier bench``: run the named benchmarks, print their records, plot and check."""
    records = run_benchmarks(args.names or list(bench.BENCHMARKS), quick=args.quick)
    print_records(records, as_json=args.json, quick=args.quick)
    if args.plot:
        from kvtier_async.bench.plot import PlotUnavailableError, write_plots

        try:
            paths = write_plots(records, args.plot, quick=args.quick)
        except PlotUnavailableError as exc:
            print(f"kvtier bench: {exc}", file=sys.stderr)
            return 1
        _progress(f"bench: {len(paths)} figures written to {args.plot}")
    if args.check and (missed := misses(records)):
        for record in missed:
            _progress(
                f"bench --check: {record.bench} {record.case} {record.metric}: "
                f"{record.ratio:.2f}x, target {record.target:.2f}x"
            )
        return 1
    return 0


def run_benchmarks(names: Sequence[str], *, quick: bool) -> list[BenchRecord]:
    """Run each benchmark in *names*, noting progress on stderr; return all records (a
    quick run's without verdicts: see `as_quick`)."""
    records: list[BenchRecord] = []
    for name in names:
        _progress(f"bench {name}: running{' (quick)' if quick else ''}")
        records += bench.load(name)(quick=quick, progress=_progress)
    return as_quick(records) if quick else records


def print_records(records: Sequence[BenchRecord], *, as_json: bool, quick: bool = False) -> None:
    """Print *records* to stdout: a table, or one JSON object per line."""
    if as_json:
        for record in records:
            print(record.to_json_line())
    else:
        print(render_table(records, quick=quick))


def _progress(message: str) -> None:
    """Write a one-line progress note to stderr."""
    print(message, file=sys.stderr, flush=True)


def _demo(args: argparse.Namespace) -> int:
    """``kvtier demo``: a simulated multi-turn chat through the tiers, then a per-tier table."""
    import anyio

    from kvtier_async import demo

    report = anyio.run(
        functools.partial(demo.main, conversations=args.conversations, turns=args.turns)
    )
    print(demo.render_report(report))
    return 0


def _version(args: argparse.Namespace) -> int:
    """``kvtier version``: print the package version."""
    print(__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
