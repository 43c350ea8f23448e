"""The ``kvtier`` command: ``bench``, ``demo``, ``version``, the operations ``inspect``,
``gc`` and ``regions``, ``plan`` (CPU-tier capacity from a trace) (their work is in
`kvtier_async.ops`; this module parses and prints),
``tiny-model`` (a tiny local model vLLM can serve), and ``vllm ...``: vLLM's own command line, for
vLLM's CPU wheel, whose ``vllm`` script cannot start (see
`kvtier_async.integrations.vllm.cpu_cli`); everything after ``vllm`` is vLLM's.

This is the only place that configures log output: `configure_logging` sends the library's
``logging`` records to stderr, rendered by structlog's console renderer: warnings and errors
by default, INFO with ``-v``, DEBUG with ``-vv``. Results go to stdout (``--json``: one JSON
document); progress notes and errors go to stderr.

Exit status:

- 0: success.
- 1: a problem was found and left, or a command failed: ``bench --check`` found a missed
  target; ``inspect --verify`` found damaged blocks and did not delete them all (no
  ``--repair``, or a deletion failed), or could not read some; ``gc`` could not delete some
  blocks; ``regions --remove-stale`` left a stale region (a live process maps it); a bucket
  could not be used (unreachable, credentials, access).
- 2: a usage error: bad arguments (argparse), a path that is no directory
  (``kvtier inspect: /x: no such directory``), a malformed ``s3://`` URL, a missing bucket,
  a ``--model`` that matches no namespace, a trace file that cannot be read (``plan``).
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import structlog

from kvtier_async import __version__, defaults
from kvtier_async._extras import MissingExtraError
from kvtier_async.ops import render
from kvtier_async.ops.layout import OpsError
from kvtier_async.ops.traces import FORMATS as TRACE_FORMATS
from kvtier_async.ops.traces import TraceError

if TYPE_CHECKING:
    from kvtier_async.bench.report import BenchRecord
    from kvtier_async.ops import commands as operations

# `kvtier bench`'s modules are imported when a bench command runs, not here (the registry,
# `kvtier_async.bench.BENCHMARKS`, is a dict of strings: naming the benchmarks costs nothing).

# The operations commands import the S3 stack (aiobotocore, aiohttp) when they run, not here:
# `kvtier bench gpu` runs on GPU machines that have none of it (see ci/gpu-check).

__all__ = ["configure_logging", "main", "print_records", "run_benchmarks"]

_DESCRIPTION = "kvtier-async: a three-tier KV cache (GPU -> CPU -> files / S3)."


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line *argv* (default ``sys.argv[1:]``); return the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["vllm"]:  # vLLM's CLI, its arguments untouched
        from kvtier_async.integrations.vllm import cpu_cli

        return cpu_cli.main(args_list[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if getattr(args, "check", False) and args.quick:
        parser.error("--check judges targets, which a --quick run cannot: drop one of them")
    if args.command is _bench and args.trace and args.names not in ([], ["ledger"]):
        parser.error("--trace is for the ledger benchmark: kvtier bench ledger --trace FILE")
    handler = configure_logging(args.verbose)
    try:
        status: int = args.command(args)
        return status
    except MissingExtraError as exc:  # one line naming the extra, not a traceback
        print(f"kvtier: {exc}", file=sys.stderr)
        return 2
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
    run.add_argument(
        "--trace",
        metavar="FILE",
        help="ledger only: replay this trace file instead (one JSON object a line: "
        "Mooncake's hash_ids, or kvtier's request_id/keys/arrival_s)",
    )
    run.add_argument(
        "--trace-format",
        choices=TRACE_FORMATS,
        default="auto",
        help="the --trace file's format (default auto: told by the first line's fields)",
    )
    run.set_defaults(command=_bench)
    show = commands.add_parser("demo", help="a simulated multi-turn chat through the tiers")
    show.add_argument("--conversations", type=_positive, default=24, help="default 24")
    show.add_argument("--turns", type=_positive, default=5, help="turns each, default 5")
    show.set_defaults(command=_demo)
    commands.add_parser("version", help="print the version").set_defaults(command=_version)
    doctor = commands.add_parser("doctor", help="which paths are native here, and why not")
    doctor.add_argument("--json", action="store_true", help="print one JSON document")
    doctor.set_defaults(command=_doctor)
    tiny = commands.add_parser(
        "tiny-model", help="write a tiny Llama-style model (random weights) for vLLM's CPU build"
    )
    tiny.add_argument("directory", help="where to write it (made if missing)")
    tiny.add_argument("--seed", type=int, default=0, help="default 0")
    tiny.set_defaults(command=_tiny_model)
    commands.add_parser(
        "vllm", help="vLLM's own command line (kvtier vllm serve ...), for vLLM's CPU wheel"
    )
    _add_operations(commands)
    _add_fleet(commands)
    return parser


def _add_fleet(commands: Any) -> None:  # argparse's private _SubParsersAction
    """``kvtier fleet index|router``: the fleet's prefix index, and the reference router."""
    fleet = commands.add_parser("fleet", help="a fleet's prefix index and router (vLLM KV events)")
    kinds = fleet.add_subparsers(title="services", required=True, metavar="SERVICE")
    recipe = kinds.add_parser(
        "recipe", help="print the path of the one-machine fleet recipe (a bash script)"
    )
    recipe.set_defaults(command=_fleet_recipe)
    for name, text in (
        ("index", "the prefix index: KV events in, /match and /engines out"),
        ("router", "the reference router: an HTTP proxy routed by the index"),
    ):
        service = kinds.add_parser(name, help=text)
        service.add_argument(
            "--events",
            default="tcp://127.0.0.1:5557",
            help="the ZMQ address to bind, that every engine's KV events "
            "publisher connects to (default tcp://127.0.0.1:5557)",
        )
        service.add_argument(
            "--engine",
            action="append",
            default=[],
            required=True,
            metavar="NAME[,url=URL][,replay=ENDPOINT]",
            help="an engine: NAME is its KV events topic; url= its HTTP base "
            "(the router needs it); replay= its publisher's replay_endpoint "
            "(to fill gaps); repeat per engine",
        )
        service.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
        service.add_argument(
            "--port",
            type=_positive,
            default=8100 if name == "index" else 8000,
            help="HTTP port (default %(default)s)",
        )
        service.add_argument(
            "--block-size",
            type=_positive,
            required=True,
            help="the engines' vLLM block size in tokens (--block-size)",
        )
        service.add_argument(
            "--offload-factor",
            type=_positive,
            default=1,
            help="GPU blocks per offloaded block (the connector's block_size "
            "over vLLM's; default 1)",
        )
        service.add_argument(
            "--max-blocks",
            type=_positive,
            default=4_000_000,
            help="keys kept per engine and medium, and per shared tier (default 4000000)",
        )
        service.add_argument(
            "--hash-seed",
            default=None,
            help="the engines' PYTHONHASHSEED, if they set one "
            "(default: this process's, else vLLM's fixed seed)",
        )
        if name == "router":
            service.add_argument(
                "--max-imbalance",
                type=_positive,
                default=4,
                help="requests in flight an engine may have above the least "
                "loaded one and still get a prompt (default 4)",
            )
        service.set_defaults(command=_fleet, service=name)


def _fleet_recipe(args: argparse.Namespace) -> int:
    """``kvtier fleet recipe``: where the package's fleet.sh is (``bash $(kvtier fleet
    recipe) up`` starts a fleet on this machine; its header lists its settings)."""
    from pathlib import Path

    print(Path(__file__).resolve().parent / "fleet" / "fleet.sh")
    return 0


def _fleet(args: argparse.Namespace) -> int:
    from kvtier_async import _extras

    try:
        _extras.require("fleet", _extras.FLEET, f"fleet {args.service}")
        from kvtier_async.fleet import service
    except MissingExtraError as exc:
        print(f"kvtier: {exc}", file=sys.stderr)
        return 2
    common = {"events": args.events, "engines": args.engine, "host": args.host,
              "port": args.port, "block_size": args.block_size,
              "offload_factor": args.offload_factor, "max_blocks": args.max_blocks,
              "seed": args.hash_seed,
              "ready": lambda where: print(f"kvtier fleet {args.service}: up, {where}",
                                           file=sys.stderr, flush=True)}  # fmt: skip
    try:
        if args.service == "index":
            service.run_index(**common)
        else:
            service.run_router(**common, max_imbalance=args.max_imbalance)
    except ValueError as exc:
        print(f"kvtier fleet {args.service}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the port or the events address is taken
        print(f"kvtier fleet {args.service}: {exc}", file=sys.stderr)
        return 1
    return 0


def _tiny_model(args: argparse.Namespace) -> int:
    """``kvtier tiny-model DIR``: `kvtier_async.tiny_model`'s model (needs transformers,
    which vLLM brings)."""
    from kvtier_async.tiny_model import build_tiny_model

    try:
        print(build_tiny_model(args.directory, seed=args.seed))
    except ImportError as exc:
        print(f"kvtier tiny-model: needs vLLM's dependencies (torch, transformers, "
              f"tokenizers): {exc}", file=sys.stderr)  # fmt: skip
        return 2
    return 0


def _add_operations(commands: Any) -> None:  # argparse's private _SubParsersAction
    """The ``inspect``, ``gc`` and ``regions`` subcommands."""
    where = "an fs tier's root directory, or s3://BUCKET[/PREFIX] (the obj tier's prefix)"
    look = commands.add_parser(
        "inspect", help="what a tier root holds: models, blocks, bytes, ages; --verify checks"
    )
    look.add_argument("location", metavar="PATH|s3://BUCKET/PREFIX", help=where)
    look.add_argument("--verify", action="store_true", help="read and check every block")
    look.add_argument(
        "--repair", action="store_true", help="delete the damaged blocks (implies --verify)"
    )
    look.add_argument("--json", action="store_true", help="print one JSON document")
    look.add_argument(
        "--jobs", type=_positive, default=None, help="reads in flight (default 4; s3: 16)"
    )
    _add_s3_flags(look)
    look.set_defaults(command=_inspect)
    trim = commands.add_parser("gc", help="delete least recently used blocks down to a size")
    trim.add_argument("location", metavar="PATH|s3://BUCKET/PREFIX", help=where)
    trim.add_argument(
        "--max-bytes",
        type=_size,
        required=True,
        metavar="N",
        help="keep at most N bytes of blocks (suffixes K, M, G, T: powers of 1024)",
    )
    trim.add_argument("--model", metavar="DIGEST", help="only this namespace (digest or name)")
    trim.add_argument("--dry-run", action="store_true", help="say what would be deleted")
    trim.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=argparse.SUPPRESS,  # adds to kvtier's own -v
        help="list every block and temporary file (and log INFO lines)",
    )
    trim.add_argument("--json", action="store_true", help="print one JSON document")
    _add_s3_flags(trim)
    trim.set_defaults(command=_gc)
    shm = commands.add_parser("regions", help="the CPU tier's shared regions and their owners")
    shm.add_argument(
        "--dir",
        default=defaults.REGION_DIR,
        help=f"where the regions are (default {defaults.REGION_DIR})",
    )
    shm.add_argument(
        "--remove-stale",
        action="store_true",
        help="remove the regions of dead processes that nobody maps",
    )
    shm.add_argument("--json", action="store_true", help="print one JSON document")
    shm.set_defaults(command=_regions)
    plan = commands.add_parser(
        "plan", help="hit rate against CPU-tier capacity, per policy, from a trace of your traffic"
    )
    plan.add_argument("--trace", required=True, metavar="FILE", help="the trace file to replay")
    plan.add_argument(
        "--trace-format",
        choices=TRACE_FORMATS,
        default="auto",
        help="its format (default auto: told by the first line's fields)",
    )
    plan.add_argument(
        "--capacities",
        type=_capacities,
        metavar="LIST",
        help="capacities to try: shares of the distinct blocks and block counts "
        "(default 1%%,2%%,5%%,10%%,15%%,20%%,25%%,35%%,50%%)",
    )
    plan.add_argument(
        "--policies",
        type=_names,
        metavar="LIST",
        help="eviction policies to compare, comma-separated (default "
        "lru,arc,prefix,reuse,sieve,s3fifo,tinylfu,adaptive)",
    )
    plan.add_argument(
        "--block-bytes",
        type=_size,
        metavar="N",
        help="one block's KV bytes (suffixes K, M, G): adds cpu_bytes_to_use to the table",
    )
    plan.add_argument("--json", action="store_true", help="print one JSON document")
    plan.add_argument("--plot", metavar="PNG", help="also write the curves there (matplotlib)")
    plan.set_defaults(command=_plan)


def _add_s3_flags(parser: argparse.ArgumentParser) -> None:
    """How to reach a bucket; credentials come from the AWS chain, never from flags."""
    group = parser.add_argument_group(
        "s3 (credentials: the standard AWS chain, e.g. AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)"
    )
    group.add_argument(
        "--endpoint", default="", help="host:port or http(s)://host:port (default: AWS S3)"
    )
    group.add_argument("--region", default="", help="default: us-east-1 with --endpoint")
    group.add_argument(
        "--timeout", type=_seconds, default=5.0, help="seconds per request (default 5)"
    )


def _positive(text: str) -> int:
    """Argparse type: a positive integer."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _size(text: str) -> int:
    """Argparse type: a byte count with an optional K/M/G/T suffix."""
    try:
        return render.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seconds(text: str) -> float:
    """Argparse type: a positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"expected seconds in (0, 3600], got {text!r}")
    return value


def _names_help() -> str:
    """Help text for ``bench NAME``, listing the registered benchmarks."""
    from kvtier_async import bench

    return f"benchmark to run, one of: {', '.join(bench.BENCHMARKS)}"


def _bench_name(name: str) -> str:
    """Argparse type of a benchmark name: unknown names are a usage error (exit 2)."""
    from kvtier_async import bench

    if name not in bench.BENCHMARKS:
        valid = ", ".join(bench.BENCHMARKS)
        raise argparse.ArgumentTypeError(f"unknown benchmark {name!r}; valid names: {valid}")
    return name


def _bench(args: argparse.Namespace) -> int:
    """``kvtier bench``: run the named benchmarks, print their records, plot and check."""
    from kvtier_async import bench
    from kvtier_async.bench.report import misses

    options: dict[str, dict[str, Any]] = {}
    if args.trace:
        options["ledger"] = {"trace": args.trace, "trace_format": args.trace_format}
    names = args.names or (["ledger"] if args.trace else list(bench.BENCHMARKS))
    try:
        records = run_benchmarks(names, quick=args.quick, options=options)
    except TraceError as exc:  # a bad trace file: one line naming the line and field
        print(f"kvtier bench: {exc}", file=sys.stderr)
        return 2
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


def run_benchmarks(
    names: Sequence[str], *, quick: bool, options: dict[str, dict[str, Any]] | None = None
) -> list[BenchRecord]:
    """Run each benchmark in *names*, noting progress on stderr; return all records (a
    quick run's without verdicts: see `as_quick`). ``options[name]``: more keyword
    arguments for that benchmark (the ledger's ``trace``)."""
    from kvtier_async import bench
    from kvtier_async.bench.report import as_quick

    records: list[BenchRecord] = []
    for name in names:
        _progress(f"bench {name}: running{' (quick)' if quick else ''}")
        function: Callable[..., list[BenchRecord]] = bench.load(name)
        records += function(quick=quick, progress=_progress, **(options or {}).get(name, {}))
    return as_quick(records) if quick else records


def print_records(records: Sequence[BenchRecord], *, as_json: bool, quick: bool = False) -> None:
    """Print *records* to stdout: a table, or one JSON object per line."""
    from kvtier_async.bench.report import render_table

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


def _s3_options(args: argparse.Namespace) -> operations.S3Options:
    from kvtier_async.ops import commands as operations

    jobs = getattr(args, "jobs", None) or 16
    return operations.S3Options(args.endpoint, args.region, args.timeout, jobs)


_Errors: TypeAlias = tuple[type[Exception], ...]


def _operation(name: str, fn: Callable[[argparse.Namespace], int]) -> Callable[..., int]:
    """Run ``fn``; a bad location or argument exits 2, a bucket that cannot be used 1,
    each with a line on stderr that names what is wrong."""

    @functools.wraps(fn)
    def run(args: argparse.Namespace) -> int:
        usage, unusable, said = _s3_errors()
        try:
            return fn(args)
        except Exception as exc:
            if isinstance(exc, (OpsError, *usage)):
                print(f"kvtier {name}: {exc}", file=sys.stderr)
                return 2
            if not isinstance(exc, unusable):
                raise
            # its text, and its type where the text alone may not say what failed
            text = str(exc) if isinstance(exc, said) else f"{type(exc).__name__}: {exc}"
            print(f"kvtier {name}: {text}", file=sys.stderr)
            return 1

    return run


def _s3_errors() -> tuple[_Errors, _Errors, _Errors]:
    """The obj tier's errors that are usage errors, those that say a bucket cannot be used,
    and those whose text says all; none without the s3 extra (no bucket is reached then)."""
    from kvtier_async import _extras

    if _extras.missing(_extras.S3):
        return (), (), ()
    from kvtier_async.ops.s3root import REQUEST_ERRORS
    from kvtier_async.tiers.s3 import BucketNotFoundError, TierOpenError

    return (BucketNotFoundError,), (TierOpenError, *REQUEST_ERRORS), (TierOpenError, OSError)


def _inspect_args(args: argparse.Namespace) -> int:
    """``kvtier inspect``: the report, and with --verify the damaged blocks."""
    from kvtier_async.ops import commands as operations

    verify = args.verify or args.repair
    jobs = args.jobs or (16 if operations.remote(args.location) else 4)

    def progress(blocks: int, nbytes: int) -> Callable[[int, int], None]:
        bar = render.Progress("verify", blocks, nbytes, sys.stderr)
        bars.append(bar)
        return bar

    bars: list[render.Progress] = []
    root, checked = operations.inspect(
        args.location,
        verify=verify,
        repair=args.repair,
        jobs=jobs,
        s3=_s3_options(args),
        progress=progress,
    )
    for bar in bars:
        bar.finish()
    if args.json:
        document = render.root_json(root)
        if checked is not None:
            document["verify"] = render.verification_json(checked, repair=args.repair)
        print(render.to_json(document))
    else:
        print(render.root_text(root))
        if checked is not None:
            print()
            print(render.verification_text(checked, repair=args.repair))
    problems = checked is not None and (
        not checked.repaired or bool(checked.errors) or bool(checked.disagree)
    )
    return 1 if problems else 0


def _gc_args(args: argparse.Namespace) -> int:
    """``kvtier gc``: plan (and unless --dry-run, delete) least recently used blocks."""
    from kvtier_async.ops import commands as operations

    plan, result = operations.gc(
        args.location,
        args.max_bytes,
        model=args.model,
        dry_run=args.dry_run,
        s3=_s3_options(args),
    )
    if args.json:
        print(render.to_json(render.gc_json(plan, result)))
    else:
        print(render.gc_text(plan, result, listed=args.verbose > 0))
    return 1 if result is not None and result.failed else 0


def _regions_args(args: argparse.Namespace) -> int:
    """``kvtier regions``: the regions, and with --remove-stale those removed and kept."""
    from kvtier_async.ops import commands as operations

    found, removed, kept = operations.list_regions(args.dir, remove_stale=args.remove_stale)
    if args.json:
        print(render.to_json(render.regions_json(args.dir, found, removed, kept)))
    else:
        print(render.regions_text(args.dir, found, removed, kept))
    return 1 if kept else 0


_inspect = _operation("inspect", _inspect_args)
_gc = _operation("gc", _gc_args)
_regions = _operation("regions", _regions_args)


def _plan(args: argparse.Namespace) -> int:
    """``kvtier plan``: replay the trace per policy and capacity (see `kvtier_async.ops.plan`)."""
    from kvtier_async.ledger import check_policy
    from kvtier_async.ops import plan
    from kvtier_async.ops.traces import read_trace

    policies = args.policies or list(plan.DEFAULT_POLICIES)
    for name in policies:
        try:
            check_policy(name)
        except ValueError as exc:
            print(f"kvtier plan: --policies: {exc}", file=sys.stderr)
            return 2
    try:
        source = read_trace(args.trace, args.trace_format)
    except (TraceError, OSError) as exc:
        print(f"kvtier plan: {exc}", file=sys.stderr)
        return 2

    def note(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        result = plan.make_plan(
            source,
            capacities=args.capacities,
            policies=policies,
            block_bytes=args.block_bytes,
            progress=note,
        )
    except ValueError as exc:
        print(f"kvtier plan: {exc}", file=sys.stderr)
        return 2
    if args.plot:
        note(f"plan: wrote {plan.write_plot(result, args.plot, render.format_size)}")
    print(plan.plan_json(result) if args.json else plan.render_plan(result, render.format_size))
    return 0


def _capacities(text: str) -> list[str]:
    """Argparse type: ``5%,10%,20000``."""
    from kvtier_async.ops.plan import parse_capacities

    try:
        return parse_capacities(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _names(text: str) -> list[str]:
    """Argparse type: a comma-separated list of names."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return names


def _doctor(args: argparse.Namespace) -> int:
    """``kvtier doctor``: one line per part (see `kvtier_async.doctor`)."""
    from dataclasses import asdict

    from kvtier_async import doctor

    checks = doctor.report()
    if args.json:
        print(render.to_json({"checks": [asdict(c) for c in checks]}))
        return 0
    width = max(len(c.part) for c in checks)
    for c in checks:
        print(f"{c.part:<{width}}  {c.path}  ({c.detail})")
    return 0


def _version(args: argparse.Namespace) -> int:
    """``kvtier version``: print the package version."""
    print(__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
