"""The parent's side of an engine process: `run_engine`."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["EngineProcess", "EngineRunError", "engine_env", "run_engine", "stop_group"]

_LOG_TAIL = 6000
#: The folder holding the kits (``tests/kits``): an engine process imports this kit from it.
KITS = Path(__file__).resolve().parents[1]


def engine_env(
    *,
    multiprocess: bool = False,
    kv_cache_gib: int = 1,
    tensor_parallel_size: int = 1,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of an engine process: offline (``HF_HUB_OFFLINE``), vLLM's CPU KV
    cache of ``kv_cache_gib`` GiB, the engine in this process unless ``multiprocess``, and
    with tensor parallelism one core bound per worker (vLLM's CPU backend refuses to bind
    two workers on one NUMA node itself), and the kits' folder first on ``PYTHONPATH`` (the
    engine process is ``python -m engine_kit``)."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(KITS), env.get("PYTHONPATH"))))
    env["HF_HUB_OFFLINE"] = "1"
    env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    if tensor_parallel_size > 1:
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < tensor_parallel_size:
            raise RuntimeError(
                f"tensor_parallel_size={tensor_parallel_size} needs as many cores, "
                f"this process may run on {len(cores)}"
            )
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, cores[:tensor_parallel_size]))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


class EngineRunError(RuntimeError):
    """An engine process failed or ran past its deadline; the message ends with its log."""


def run_engine(
    spec: Mapping[str, Any],
    *,
    workdir: str | os.PathLike[str],
    multiprocess: bool = False,
    kv_cache_gib: int = 1,
    timeout_s: float = 600.0,
    name: str | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Run one engine process on ``spec`` (see `engine_kit.__main__`) and
    return its result. Its output goes to ``workdir/NAME.log``. At ``timeout_s`` its whole
    process group is killed; a failure raises `EngineRunError` with the log's tail."""
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    name = name or f"engine-{uuid.uuid4().hex[:8]}"
    spec_path, out_path, log_path = (
        work / f"{name}{ext}" for ext in (".spec.json", ".out.json", ".log")
    )
    spec_path.write_text(json.dumps(spec))
    tp = int((spec.get("engine") or {}).get("tensor_parallel_size", 1))
    environment = engine_env(
        multiprocess=multiprocess, kv_cache_gib=kv_cache_gib, tensor_parallel_size=tp, base=env
    )
    command = [sys.executable, "-m", "engine_kit", str(spec_path), str(out_path)]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_group(process, grace_s=5.0)
            raise EngineRunError(f"{name}: ran past {timeout_s:.0f} s\n{_tail(log_path)}") from None
        finally:
            stop_group(process, grace_s=5.0)  # stray children (vLLM's workers) too
    if not out_path.exists():
        raise EngineRunError(f"{name}: exited {code} without a result\n{_tail(log_path)}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    if code != 0 or "error" in result:
        raise EngineRunError(f"{name}: {result.get('error', f'exit {code}')}\n{_tail(log_path)}")
    result["log"] = str(log_path)
    return result


def stop_group(process: subprocess.Popen[Any], *, grace_s: float) -> None:
    """End ``process`` and every process of its group (it leads a session of its own):
    SIGTERM, then SIGKILL to whatever is left after ``grace_s`` (a region reaper finishing
    its work, see `kvtier_async.memory._reaper`, gets that long too)."""
    deadline = time.monotonic() + grace_s
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace_s)
    while _group_alive(process.pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # a poll of processes that are exiting, not a timed race
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace_s)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _tail(path: Path) -> str:
    text = path.read_text(errors="replace")
    return text[-_LOG_TAIL:]


_ANSWER = "KVTIER-ENGINE-ANSWER "  # the engine process's `ANSWER` (not imported: no vLLM here)


class EngineProcess:
    """An interactive engine process: started once, then `do` one op at a time, so the
    measurements of several engines interleave (only one works at a time: each takes every
    core). Its output, vLLM's logs, goes to ``workdir/NAME.log``; every answer has a
    deadline; leaving the ``with`` ends it (its group, like `run_engine`)."""

    def __init__(
        self,
        spec: Mapping[str, Any],
        *,
        workdir: str | os.PathLike[str],
        name: str,
        multiprocess: bool = False,
        kv_cache_gib: int = 1,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        self.name = name
        self.timeout_s = timeout_s
        work = Path(workdir)
        work.mkdir(parents=True, exist_ok=True)
        self._spec_path = work / f"{name}.spec.json"
        self._out_path = work / f"{name}.out.json"
        self.log_path = work / f"{name}.log"
        self._spec_path.write_text(json.dumps({**spec, "ops": None}))
        tp = int((spec.get("engine") or {}).get("tensor_parallel_size", 1))
        self._env = engine_env(
            multiprocess=multiprocess, kv_cache_gib=kv_cache_gib, tensor_parallel_size=tp, base=env
        )
        self._answers: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self._process: subprocess.Popen[str] | None = None
        self.startup_s = 0.0

    def __enter__(self) -> EngineProcess:
        command = [sys.executable, "-m", "engine_kit", str(self._spec_path), str(self._out_path)]
        log = open(self.log_path, "w")
        process = subprocess.Popen(
            command, env=self._env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=log, text=True, start_new_session=True,
        )  # fmt: skip
        self._process = process
        threading.Thread(target=self._read, args=(process, log), daemon=True).start()
        try:
            self.startup_s = float(self._next("start")["startup_s"])
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _read(self, process: subprocess.Popen[str], log: Any) -> None:
        """Answers to the queue, the rest to the log; None at the end of the output."""
        assert process.stdout is not None
        try:
            for line in process.stdout:
                if line.startswith(_ANSWER):
                    self._answers.put(json.loads(line[len(_ANSWER) :]))
                else:
                    log.write(line)
        finally:
            log.close()
            self._answers.put(None)

    def _next(self, what: str) -> dict[str, Any]:
        try:
            answer = self._answers.get(timeout=self.timeout_s)
        except queue.Empty:
            raise EngineRunError(
                f"{self.name}: no answer to {what} within {self.timeout_s:.0f} s\n"
                f"{_tail(self.log_path)}"
            ) from None
        if answer is None:
            raise EngineRunError(f"{self.name}: ended before {what}\n{_tail(self.log_path)}")
        return answer

    def do(self, op: Mapping[str, Any]) -> dict[str, Any]:
        """Run ``op`` (see `engine_kit.__main__`); its result."""
        process = self._process
        if process is None or process.stdin is None:
            raise EngineRunError(f"{self.name}: not running")
        process.stdin.write(json.dumps(op) + "\n")
        process.stdin.flush()
        return self._next(f"op {op.get('op')!r}")

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        try:
            if process.stdin is not None:
                with contextlib.suppress(OSError):
                    process.stdin.write(json.dumps({"op": "exit"}) + "\n")
                    process.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=60)  # its shutdown: the last cascades, bounded
        finally:
            stop_group(process, grace_s=5.0)
