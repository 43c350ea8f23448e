"""The operations on a bucket prefix that the obj tier (or a synced fs root) filled: list it,
verify its objects, delete damaged or least recently modified ones. asyncio only, as the obj
tier (aiobotocore).

*Names.* Block objects are named ``<prefix>/`` + the fs tier's relative path, so a listing is
sorted into namespaces, ranks and blocks by the same rules as a walk of a directory
(`layout.classify`). The obj tier writes no ``config.json``; a root synced from an fs tier
has one per namespace, read when listed (the report says which).

*Client and deadlines.* `connect` opens the obj tier's own client (`client.enter_client`:
path-style addressing for an endpoint, botocore's retries off) and probes the bucket
(`client.probe_bucket`, whose errors say what to fix); every request then goes through the
tier's request layer (`requests.Requests`: each attempt within ``timeout_s``, retries with
backoff, a circuit breaker): a listing page, a GET, a DELETE. Credentials come from the
standard AWS chain (environment, profile, instance role), never from the command line.

*Live buckets.* An object deleted after the listing is counted as vanished; one written after
it is not seen. GC orders blocks by ``LastModified`` with the fs tier's own order
(`layout.lru_victims`) and deletes with ``DeleteObjects``, 1000 names a request. Objects
named like the fs tier's temporaries (a synced root's leftovers) are listed, never deleted.
"""

from __future__ import annotations

import datetime
import functools
import json
import re
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any, Final

import aiohttp
import anyio
from botocore import exceptions as boto_errors  # type: ignore[import-untyped]

from kvtier_async.config import ConfigError
from kvtier_async.ops.layout import (
    CONFIG_NAME,
    Namespace,
    OpsError,
    Root,
    check_block,
    lru_victims,
    pick_namespace,
    too_large,
)
from kvtier_async.ops.results import Damage, Disagreement, GcPlan, GcResult, Verification
from kvtier_async.tiers.blockfile import CorruptBlockError, block_key
from kvtier_async.tiers.s3.breaker import (
    DEFAULT_BREAKER_OPEN_S,
    DEFAULT_BREAKER_THRESHOLD,
    DEFAULT_BREAKER_TIMEOUTS,
    Breaker,
)
from kvtier_async.tiers.s3.client import enter_client, probe_bucket, read_into
from kvtier_async.tiers.s3.config import DEFAULT_TIMEOUT_S, S3Config, Scrubber
from kvtier_async.tiers.s3.errors import TierOpenError
from kvtier_async.tiers.s3.requests import DEFAULT_BACKOFF_S, Requests, status_of

__all__ = ["REQUEST_ERRORS", "Bucket", "S3Location", "connect", "parse_url"]

# What a request that failed for good raises (after its retries): a bucket the command could
# open may still refuse a listing, or its endpoint go away.
REQUEST_ERRORS: Final = (
    boto_errors.BotoCoreError,
    boto_errors.ClientError,
    aiohttp.ClientError,
    OSError,
)
_DELETE_BATCH: Final = 1000  # DeleteObjects takes at most 1000 names
_CONFIG_MAX: Final = 1 << 20
_EPOCH: Final = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
_URL_FORM: Final = "expected s3://BUCKET or s3://BUCKET/PREFIX"
# Command-line flags for the config fields a user sets (errors name the flag).
# The obj tier's config fields in its open errors, as the command calls them.
_FIELD_NAMES: Final = {
    "endpoint_override": "--endpoint",
    "access_key": "AWS_ACCESS_KEY_ID",
    "secret_key": "AWS_SECRET_ACCESS_KEY",
    "session_token": "AWS_SESSION_TOKEN",
    "ca_bundle": "AWS_CA_BUNDLE",
}
_FIELD_RE: Final = re.compile(r"\b(" + "|".join(_FIELD_NAMES) + r")\b")
_FLAGS: Final = {
    "endpoint_override": "--endpoint",
    "region": "--region",
    "bucket": "BUCKET",
    "timeout_s": "--timeout",
    "max_concurrency": "--jobs",
}


@dataclass(frozen=True)
class S3Location:
    """``s3://bucket/prefix``, taken apart."""

    url: str
    bucket: str
    prefix: str

    def object_name(self, relpath: str) -> str:
        return f"{self.prefix}/{relpath}" if self.prefix else relpath


def parse_url(url: str) -> S3Location:
    """``s3://BUCKET[/PREFIX]``; `OpsError` saying the form expected otherwise."""
    if not url.startswith("s3://"):
        raise OpsError(f"{url!r}: {_URL_FORM}")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    if not bucket or "\x00" in url or any(c.isspace() for c in bucket):
        raise OpsError(f"{url!r}: {_URL_FORM}")
    return S3Location(url, bucket, prefix.strip("/"))


@asynccontextmanager
async def connect(
    location: S3Location,
    *,
    endpoint: str = "",
    region: str = "",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    concurrency: int = 16,
) -> AsyncIterator[Bucket]:
    """The bucket of ``location``, its client open and the bucket probed (a
    `kvtier_async.tiers.s3.TierOpenError` says what is wrong); closed at the end."""
    config = _config(location, endpoint, region, timeout_s, concurrency)
    client: list[Any] = []

    async def head_bucket() -> Any:
        return await client[0].head_bucket(Bucket=config.bucket)

    breaker = Breaker(
        DEFAULT_BREAKER_THRESHOLD,
        DEFAULT_BREAKER_OPEN_S,
        anyio.current_time,
        DEFAULT_BREAKER_TIMEOUTS,
    )
    requests = Requests(
        location.url, config, breaker, DEFAULT_BACKOFF_S, head_bucket, Scrubber().describe
    )
    stack = AsyncExitStack()
    try:
        try:
            client.append(await enter_client(stack, requests))
            await probe_bucket(requests, client[0])
        except TierOpenError as exc:
            exc.args = (_for_the_command(str(exc), location), *exc.args[1:])
            raise
        yield Bucket(location, config, client[0], requests)
    finally:
        with anyio.move_on_after(config.timeout_s, shield=True):  # as the tier's aclose
            await stack.aclose()


def _for_the_command(message: str, location: S3Location) -> str:
    """The obj tier's message with its config fields as the command's flags and the AWS
    chain's variables."""
    message = re.sub(r"^bucket: ", f"{location.url}: ", message)
    message = re.sub(r"^region: ", "--region: ", message)
    return _FIELD_RE.sub(lambda m: _FIELD_NAMES[m[0]], message)


def _config(
    location: S3Location, endpoint: str, region: str, timeout_s: float, concurrency: int
) -> S3Config:
    """The obj tier's config for the command's flags; a bad one is an `OpsError` naming
    the flag."""
    data = {
        "type": "obj",
        "bucket": location.bucket,
        "endpoint_override": endpoint,
        "region": region,
        "prefix": location.prefix,
        "timeout_s": timeout_s,
        "max_concurrency": concurrency,
    }
    try:
        return S3Config.parse(data)
    except ConfigError as exc:
        flag = _FLAGS.get(exc.field, exc.field)
        raise OpsError(f"{flag}: {str(exc).removeprefix(f'{exc.field}: ')}") from None


class Bucket:
    """One open bucket prefix (see the module docstring)."""

    def __init__(
        self, location: S3Location, config: S3Config, client: Any, requests: Requests
    ) -> None:
        self.location = location
        self.config = config
        self.client = client
        self.requests = requests
        self.page_size = 1000  # ListObjectsV2's MaxKeys (1000: the most S3 returns)

    # -- listing ---------------------------------------------------------------------------

    async def walk(self) -> Root:
        """Every object below the prefix, sorted into namespaces, and their config.json."""
        root = Root(self.location.url, "s3")
        configs: set[str] = set()
        async for key, size, modified in self._objects():
            relpath = key[len(self.location.object_name("")) :]
            root.add(relpath, size, modified, regular=True, writer="unknown")
            name, _, rest = relpath.partition("/")
            if rest == CONFIG_NAME:
                configs.add(name)
        for ns in root.namespaces.values():
            if ns.name in configs:
                await self._read_config(ns)
            else:
                ns.config_note = (
                    "no config.json object (the obj tier writes none; a root synced from "
                    "an fs tier has one)"
                )
        return root

    async def _objects(self) -> AsyncIterator[tuple[str, int, int]]:
        """``(key, size, LastModified in ns)`` of every object below the prefix, a page of
        ListObjectsV2 per request."""
        prefix = self.location.object_name("")
        token: dict[str, str] = {}
        while True:
            call = functools.partial(
                self.client.list_objects_v2,
                Bucket=self.config.bucket,
                Prefix=prefix,
                MaxKeys=self.page_size,
                **token,
            )
            page = await self.requests.send(call)
            for item in page.get("Contents", []):
                yield item["Key"], int(item["Size"]), _nanoseconds(item["LastModified"])
            if not page.get("IsTruncated"):
                return
            token = {"ContinuationToken": page["NextContinuationToken"]}

    async def _read_config(self, ns: Namespace) -> None:
        name = self.location.object_name(f"{ns.name}/{CONFIG_NAME}")
        try:
            body = await self.requests.send(functools.partial(self._get, name, _CONFIG_MAX))
            data = json.loads(bytes(body))
        except boto_errors.ClientError as exc:
            ns.config_note = f"config.json unreadable: {self.requests.describe(exc)}"
            return
        except (ValueError, CorruptBlockError) as exc:
            ns.config_note = f"config.json unreadable: {exc}"
            return
        if isinstance(data, dict):
            ns.config = data
        else:
            ns.config_note = "config.json is not a JSON object"

    async def _get(self, name: str, limit: int) -> memoryview:
        """The whole body of object ``name`` (`CorruptBlockError` if longer than
        ``limit``), read within the attempt's deadline."""
        response = await self.client.get_object(Bucket=self.config.bucket, Key=name)
        stream = response["Body"]
        try:
            size = int(response["ContentLength"])
            if size > limit:
                raise CorruptBlockError(f"object is {size} bytes, more than {limit}")
            view = memoryview(bytearray(size))
            await read_into(stream, view)
        finally:
            stream.close()
        return view

    # -- verifying -------------------------------------------------------------------------

    async def verify(
        self,
        root: Root,
        *,
        progress: Callable[[int, int], None] = lambda blocks, nbytes: None,
    ) -> Verification:
        """GET and check every block object of ``root``, ``max_concurrency`` at a time;
        ``progress(blocks, bytes)`` hears of each one."""
        items = [(ns, block) for ns in root.sorted_namespaces() for block in ns.blocks]
        result = Verification(total=len(items))
        started = anyio.current_time()
        pending = iter(items)

        async def worker() -> None:
            for ns, block in pending:
                outcome, nbytes = await self._verify_one(ns, block.relpath, block.size)
                result.record(block.relpath, outcome, nbytes)
                progress(1, nbytes)

        async with anyio.create_task_group() as tg:
            for _ in range(min(len(items), self.config.max_concurrency)):
                tg.start_soon(worker)
        result.seconds = anyio.current_time() - started
        result.damaged.sort(key=lambda d: d.relpath)
        result.errors.sort()
        return result

    async def _verify_one(
        self, ns: Namespace, relpath: str, size: int
    ) -> tuple[Damage | Disagreement | str | None, int]:
        key = block_key(relpath)
        if key is None:
            return Damage(
                relpath, "not named like a block file (<hex key>.bin in <hh>_g<group>)"
            ), 0
        if (damage := too_large(size)) is not None:
            return Damage(relpath, str(damage)), 0
        name = self.location.object_name(relpath)
        try:
            data = await self.requests.send(functools.partial(self._get, name, size + 1))
        except CorruptBlockError as exc:  # grew since the listing, past any block
            return Damage(relpath, str(exc)), 0
        except Exception as exc:
            if status_of(exc) == 404:
                return "vanished", 0
            return f"{relpath}: {self.requests.describe(exc)}", 0
        try:
            claimed = check_block(data, key, ns.block_bytes)
        except CorruptBlockError as exc:
            return Damage(relpath, str(exc)), data.nbytes
        if claimed is not None and ns.block_bytes is not None:
            return Disagreement(relpath, claimed, ns.block_bytes), data.nbytes
        return None, data.nbytes

    # -- deleting --------------------------------------------------------------------------

    async def delete(self, relpaths: Sequence[str]) -> tuple[list[str], list[str]]:
        """Delete the objects ``relpaths`` name, 1000 a request: ``(deleted, failures)``
        (a failure: ``relpath: why``)."""
        deleted: list[str] = []
        failures: list[str] = []
        for start in range(0, len(relpaths), _DELETE_BATCH):
            batch = list(relpaths[start : start + _DELETE_BATCH])
            objects = [{"Key": self.location.object_name(r)} for r in batch]
            call = functools.partial(
                self.client.delete_objects,
                Bucket=self.config.bucket,
                Delete={"Objects": objects, "Quiet": True},
            )
            try:
                answer = await self.requests.send(call)
            except Exception as exc:
                failures += [f"{r}: {self.requests.describe(exc)}" for r in batch]
                continue
            refused = {
                e["Key"]: f"{e.get('Code', '')} {e.get('Message', '')}".strip()
                for e in answer.get("Errors", [])
            }
            for relpath in batch:
                why = refused.get(self.location.object_name(relpath))
                if why is None:
                    deleted.append(relpath)
                else:
                    failures.append(f"{relpath}: {why}")
        return deleted, failures

    async def repair(self, damaged: Sequence[Damage]) -> tuple[list[Damage], list[Damage]]:
        """Delete the damaged objects: ``(removed, kept)``."""
        deleted = set((await self.delete([d.relpath for d in damaged]))[0])
        removed = [d for d in damaged if d.relpath in deleted]
        return removed, [d for d in damaged if d.relpath not in deleted]

    # -- gc --------------------------------------------------------------------------------

    async def gc_plan(self, max_bytes: int, namespace: str | None = None) -> GcPlan:
        """What `gc_apply` deletes to bring the blocks (of ``namespace``, or all) to at
        most ``max_bytes``, least recently modified first."""
        root = await self.walk()
        names = sorted(root.namespaces)
        if namespace is not None:
            names = [pick_namespace(self.location.url, names, namespace)]
        blocks = [block for name in names for block in root.namespaces[name].blocks]
        plan = GcPlan(self.location.url, max_bytes, names if namespace is not None else None)
        plan.blocks, plan.bytes = len(blocks), sum(b.size for b in blocks)
        plan.victims = lru_victims(blocks, max_bytes)
        plan.live_temps = sum(len(root.namespaces[name].temps) for name in names)
        return plan

    async def gc_apply(self, plan: GcPlan) -> GcResult:
        """Delete the blocks ``plan`` lists."""
        result = GcResult(plan)
        deleted, result.failed = await self.delete([b.relpath for b in plan.victims])
        done = set(deleted)
        result.deleted = [b for b in plan.victims if b.relpath in done]
        return result


def _nanoseconds(moment: datetime.datetime) -> int:
    """``moment`` as integer nanoseconds since the epoch (no float rounding)."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return (moment - _EPOCH) // datetime.timedelta(microseconds=1) * 1000
