"""``kvtier fleet``: the index as a process (up, answering, stopped by SIGTERM within a
bound), bad arguments named, and the recipe where ``kvtier fleet recipe`` says."""

from __future__ import annotations

import json
import queue
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")
pytest.importorskip("aiohttp")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


MAIN = "import sys; from kvtier_async.cli import main; sys.exit(main(sys.argv[1:]))"
KVTIER = (sys.executable, "-c", MAIN)


def _kvtier(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVTIER, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["index", "--engine", "a", "--engine", "a"], "'a' given twice"),
        (["router", "--engine", "a"], "the router needs url=http://HOST:PORT"),
        (["index", "--engine", "a,replay"], "allowed are url=URL and replay="),
    ],
)
def test_bad_engines_are_named_and_exit_2(args: list[str], message: str) -> None:
    done = _kvtier("fleet", *args, "--block-size", "16")
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_a_taken_events_address_is_said_and_exits_1() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _kvtier(
            "fleet",
            "index",
            "--engine",
            "a",
            "--block-size",
            "16",
            "--events",
            f"tcp://127.0.0.1:{port}",
            "--port",
            str(_port()),
        )
    assert done.returncode == 1 and "cannot bind" in done.stderr, done.stderr


def test_the_index_runs_answers_and_stops_on_sigterm() -> None:
    http = _port()
    args = [
        "fleet",
        "index",
        "--engine",
        "a",
        "--block-size",
        "4",
        "--port",
        str(http),
        "--events",
        f"tcp://127.0.0.1:{_port()}",
    ]
    process = subprocess.Popen([*KVTIER, *args], stderr=subprocess.PIPE, text=True)
    assert process.stderr is not None
    stderr = process.stderr
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in stderr], daemon=True)
    reader.start()
    try:
        while "kvtier fleet index: up" not in lines.get(timeout=60):
            pass  # the ready line comes once it listens; anything before it is skipped
        body = json.dumps({"token_ids": list(range(12))}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{http}/match",
            data=body,
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            assert json.load(response) == {
                "blocks": 3,
                "block_size": 4,
                "gpu": {"a": 0},
                "cpu": {"a": 0},
                "storage": {},
            }
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0  # a bounded shutdown, exit status 0
    finally:
        process.kill()
        process.wait()
        reader.join(timeout=30)  # the pipe ends with the process; then it is closed
        stderr.close()


def test_the_recipe_ships_with_the_package() -> None:
    done = _kvtier("fleet", "recipe")
    path = Path(done.stdout.strip())
    assert done.returncode == 0 and path.name == "fleet.sh" and path.is_file()
    assert "rclone serve s3" in path.read_text()
    usage = subprocess.run(["bash", str(path)], capture_output=True, text=True, timeout=30)
    assert usage.returncode == 2 and "usage: fleet.sh up|status|engine NAME|down" in usage.stderr
