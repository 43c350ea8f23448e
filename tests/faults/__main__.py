"""``python -m faults`` (with ``tests/`` on ``sys.path``; ``nox -s faults`` runs it).

Runs each scenario (see `faults.SCENARIOS`) in a child process of its own with an outer
deadline, so a scenario that hangs is killed (its whole process group: servers, writers)
and reported as a failure, and the suite always ends. Prints one table and the failures
under it; ``--table-out PATH`` writes the same table as markdown. Exits 1 if any row has
wrong bytes served, durable blocks lost, a call blocked past its bound, a recovery past its
bound, a failed check, or a scenario that died or ran out of time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from faults import SCENARIOS, Scenario
from faults._common import Row, child_env
from faults._table import failures, render


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m faults", description=__doc__)
    parser.add_argument("names", nargs="*", help="scenarios to run (default: all)")
    parser.add_argument("--table-out", type=Path, help="also write the table here (markdown)")
    parser.add_argument("--seed", type=int, default=13, help="seed of every random choice")
    parser.add_argument("--logs", type=Path, help="directory for the scenarios' logs")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.child, args.seed, args.out)
    known = {s.name: s for s in SCENARIOS}
    unknown = sorted(set(args.names) - set(known))
    if unknown:
        parser.error(f"unknown scenarios {unknown}; known: {sorted(known)}")
    chosen = [known[name] for name in args.names] if args.names else list(SCENARIOS)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="kvtier-faults-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    return _drive(chosen, args.seed, logs, args.table_out)


def _drive(chosen: list[Scenario], seed: int, logs: Path, table_out: Path | None) -> int:
    started = time.monotonic()
    rows: list[Row] = []
    for scenario in chosen:
        began = time.monotonic()
        got = _run_child(scenario, seed, logs)
        rows += got
        bad = sum(bool(row.failures()) for row in got)
        print(
            f"faults: {scenario.name}: {len(got)} rows, {time.monotonic() - began:.1f} s"
            + (f", {bad} FAILED" if bad else ""),
            flush=True,
        )
    table = render(rows, seed=seed, seconds=time.monotonic() - started)
    print()
    print(table)
    problems = failures(rows)
    for problem in problems:
        print(f"FAILED {problem}")
    print(f"faults: logs in {logs}")
    if table_out is not None:
        table_out.parent.mkdir(parents=True, exist_ok=True)
        table_out.write_text(table + "\n")
        print(f"faults: table written to {table_out}")
    return 1 if problems else 0


def _run_child(scenario: Scenario, seed: int, logs: Path) -> list[Row]:
    out = logs / f"{scenario.name}.json"
    log = logs / f"{scenario.name}.log"
    out.unlink(missing_ok=True)
    command = [sys.executable, "-m", "faults", "--child", scenario.name, "--seed", str(seed)]
    with open(log, "wb") as sink:
        child = subprocess.Popen(
            [*command, "--out", str(out)], stdout=sink, stderr=subprocess.STDOUT,
            env=child_env(), start_new_session=True,  # a group of its own: killed whole
        )  # fmt: skip
        try:
            rc: int | None = child.wait(timeout=scenario.deadline_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            _kill_group(child.pid)
            child.wait()
    rows = [Row.from_json(item) for item in json.loads(out.read_text())] if out.exists() else []
    if rc is None:
        rows.append(_died(scenario, f"did not end within {scenario.deadline_s:.0f} s: killed"))
    elif rc != 0:
        rows.append(_died(scenario, f"exited with status {rc} (see {log})"))
    return rows


def _kill_group(pgid: int) -> None:
    """Whatever the scenario left running in its group (a server, a writer) goes too."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def _died(scenario: Scenario, why: str) -> Row:
    return Row(f"{scenario.title} (the rest)", problems=[why])


def _child(name: str, seed: int, out: Path) -> int:
    """Run one scenario and write its rows as they come; then leave at once (`os._exit`), so that a
    thread a failed scenario left behind cannot keep the process alive."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    scenario = {s.name: s for s in SCENARIOS}[name]
    status, rows = 1, []
    try:
        for row in scenario.load()(seed):  # each row saved as it comes: a kill keeps them
            rows.append(row.to_json())
            partial = out.with_suffix(".partial")
            partial.write_text(json.dumps(rows, indent=1))
            partial.replace(out)
        status = 0
    except BaseException:
        traceback.print_exc()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
