"""Trace files for ``kvtier bench ledger --trace FILE``: the requests' block keys, in order.

Two formats, one JSON object a line (blank lines are skipped), told apart by the first
object's fields unless the caller names one:

- ``mooncake``, the Mooncake trace release's (FAST'25): ``{"timestamp": ms, "input_length":
  tokens, "output_length": tokens, "hash_ids": [int, ...]}``, one id per prompt block (512
  tokens there), equal ids equal prefix blocks. Only ``hash_ids`` is required; the other
  fields, when present, must be numbers.
- ``kvtier``, ours, for a trace written from your own logs: ``{"request_id": str, "keys":
  [key, ...], "arrival_s": seconds}``, ``keys`` a request's block keys head -> tail (the
  prompt's blocks in order), ``arrival_s`` optional. A key is a block hash: a hex string
  (its bytes, at least one) or an int in ``[0, 2**64)`` (its 8 big-endian bytes, so ``255``
  and ``"00000000000000ff"`` are the same key). Equal keys are the same cached block.

Either way a key becomes an offload key of KV group 0 (`make_offload_key`); requests are
replayed in file order. A line that is not a JSON object of its format raises `TraceError`
naming the file, the line number and the field.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier_async.ledger import make_offload_key

__all__ = ["FORMATS", "TraceError", "TraceFile", "read_trace"]

FORMATS = ("auto", "mooncake", "kvtier")


class TraceError(ValueError):
    """A trace file that cannot be read: its path, the line and the field say where."""


@dataclass(frozen=True)
class TraceFile:
    """A trace file's requests (block keys head -> tail, file order) and its format."""

    name: str  # the file name without its suffix
    format: str
    requests: list[list[bytes]]


def read_trace(path: str | Path, fmt: str = "auto") -> TraceFile:
    """Read a trace file (``fmt``: ``auto``, ``mooncake`` or ``kvtier``; gzip-compressed
    when its name ends in ``.gz``)."""
    if fmt not in FORMATS:
        raise TraceError(f"trace format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    path = Path(path)
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8") as file:
                text = file.read()
        else:
            text = path.read_text(encoding="utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read the trace: {exc}") from exc
    requests: list[list[bytes]] = []
    parse: Callable[[dict[str, Any], _Where], list[bytes]] | None = None
    for where, obj in _objects(path, text):
        if parse is None:
            fmt = _detect(obj, where) if fmt == "auto" else fmt
            parse = _parse_mooncake if fmt == "mooncake" else _parse_kvtier
        requests.append(parse(obj, where))
    if not requests:
        raise TraceError(f"{path}: no requests in the trace")
    return TraceFile(Path(path.name.removesuffix(".gz")).stem, fmt, requests)


@dataclass(frozen=True)
class _Where:
    path: Path
    line: int

    def error(self, field: str, problem: str) -> TraceError:
        return TraceError(f"{self.path}:{self.line}: {field}: {problem}")


def _objects(path: Path, text: str) -> Iterator[tuple[_Where, dict[str, Any]]]:
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = _Where(path, number)
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{path}:{number}: not JSON ({exc.msg}, column {exc.colno})") from exc
        if not isinstance(obj, dict):
            raise TraceError(f"{path}:{number}: a JSON object is needed, got {_kind(obj)}")
        yield where, obj


def _detect(obj: dict[str, Any], where: _Where) -> str:
    if "hash_ids" in obj:
        return "mooncake"
    if "keys" in obj:
        return "kvtier"
    raise where.error(
        "format", "neither 'hash_ids' (mooncake) nor 'keys' (kvtier): pass --trace-format"
    )


def _parse_mooncake(obj: dict[str, Any], where: _Where) -> list[bytes]:
    for field in ("timestamp", "input_length", "output_length"):
        if field in obj and not _is_number(obj[field]):
            raise where.error(field, f"a number is needed, got {_kind(obj[field])}")
    ids = _list(obj, "hash_ids", where)
    return [_int_key(value, f"hash_ids[{i}]", where) for i, value in enumerate(ids)]


def _parse_kvtier(obj: dict[str, Any], where: _Where) -> list[bytes]:
    request_id = obj.get("request_id")
    if not isinstance(request_id, str):
        problem = (
            "missing" if request_id is None else f"a string is needed, got {_kind(request_id)}"
        )
        raise where.error("request_id", problem)
    arrival = obj.get("arrival_s")
    if arrival is not None and not (_is_number(arrival) and arrival >= 0):
        raise where.error("arrival_s", f"a number >= 0 is needed, got {arrival!r}")
    keys: list[bytes] = []
    for i, value in enumerate(_list(obj, "keys", where)):
        field = f"keys[{i}]"
        if isinstance(value, str):
            try:
                digest = bytes.fromhex(value)
            except ValueError:
                raise where.error(field, f"not a hex string: {value!r}") from None
            if not digest:
                raise where.error(field, "an empty key")
            keys.append(make_offload_key(digest, 0))
        else:
            keys.append(_int_key(value, field, where))
    return keys


def _list(obj: dict[str, Any], field: str, where: _Where) -> list[Any]:
    value = obj.get(field)
    if not isinstance(value, list):
        raise where.error(
            field, "missing" if value is None else f"a list is needed, got {_kind(value)}"
        )
    return value


def _int_key(value: Any, field: str, where: _Where) -> bytes:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 64:
        raise where.error(field, f"an int in [0, 2**64) is needed, got {value!r}")
    return make_offload_key(value.to_bytes(8, "big"), 0)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__
