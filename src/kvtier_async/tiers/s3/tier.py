"""The obj tier's face: `S3Tier` (life cycle, the tier contract, one request per key), its
statistics and its factory.

*Names and format.* Block ``key`` is object ``<prefix>/`` + `block_relpath` in ``bucket``,
and its body is a block file (`kvtier_async.tiers.blockfile`), as the fs tier writes it: a
root directory synced to a bucket, or a bucket synced to a root directory, is found and
verified by the other tier as it is.

*Store* PUTs the header page and the slot's memory as one body (`client.BlockFileBody`) with
``If-None-Match: *``: one request whether or not the object exists. An existing object
answers 412 and is left alone; the key counts as stored ("skipped"). New blocks are the usual
case, and for them this saves the HEAD of HEAD-then-PUT: on moto, 2x the store throughput at
256 KiB and 1.1x at 2 MiB. A duplicate costs an upload instead of a HEAD. A store that
answers 501 to conditional PUTs switches the tier to HEAD-then-PUT, once.

*Lookup* GETs each key (`staging`): the verified block is staged, up to ``staging_bytes`` of
them, and the load that the hit starts copies it into the slot with no request, so a hit
block costs one request, not a HEAD and a GET. When no staging buffer is free (all held by
GETs in flight; ``staging_bytes`` 0: always) the key is HEADed instead. Keys run
concurrently, up to ``max_concurrency``. A lookup's request gets ``lookup_timeout_s``
(default ``min(1.0, timeout_s)``) in all, body and retries included: a lookup that does not
answer in time is a miss, counted in ``lookup_timeouts``.

*Load* copies a staged block, or else GETs the object and streams it into the slot
(`client.read_into`). Length and checksums are verified before the key is reported loaded
(or staged). A corrupt object (wrong length, bad header, wrong key or payload checksum), on
a load or a lookup, fails its key and is deleted, so later lookups answer False, and once the
delete succeeded its key is reported by `take_removed` (the cache then announces the
removal); a missing one fails its key.

*Failures.* Every request goes through `requests.Requests` (deadlines, retries, the circuit
breaker). While the circuit is open, ``lookup`` answers all False at once and
``store``/``load`` raise `CircuitOpenError`, with no I/O, so a dead endpoint costs the engine
nothing. Per-key warnings (``obj store failed``, ...) are rate-limited (`RateLimited`: one
line per event per 10 s, then a count); ``warnings_suppressed`` counts the lines not logged.
``aclose`` waits at most ``timeout_s``, so a failed ``open`` returns within ``3 * timeout_s``
(its probe's budget, then the close).

*Start-up.* ``open`` creates one aioboto3 session and S3 client (closed by ``aclose``) and
probes the bucket (`client.probe_bucket`), raising a `TierOpenError` subclass that says what to
fix. Credentials given inline are accepted, with one warning at ``open`` that names the fields,
never their values.

*Event loop.* aiobotocore runs on asyncio only, so this tier does too (under trio, ``open``
raises `TierOpenError`); the rest of the engine runs on both. After ``open`` nothing blocks
the loop (checked with blockbuster); ``open`` itself lets botocore read its S3 model files
synchronously, a few milliseconds once per process.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, Final

import anyio
from botocore import exceptions as boto_errors  # type: ignore[import-untyped]

from kvtier_async._log import RateLimited, get_logger
from kvtier_async.tiers.base import SecondaryTier, TierContext, TierStatistics
from kvtier_async.tiers.blockfile import (
    HEADER_BYTES,
    CorruptBlockError,
    block_relpath,
    pack_header,
    verify_block,
)
from kvtier_async.tiers.fs.records import REMOVED_DAMAGED, Removed
from kvtier_async.tiers.s3.breaker import (
    DEFAULT_BREAKER_OPEN_S,
    DEFAULT_BREAKER_THRESHOLD,
    DEFAULT_BREAKER_TIMEOUTS,
    Breaker,
)
from kvtier_async.tiers.s3.client import (
    BlockFileBody,
    check_ca_bundle,
    enter_client,
    make_session,
    probe_bucket,
    read_into,
)
from kvtier_async.tiers.s3.config import ObjTierConfig, S3Config, Scrubber
from kvtier_async.tiers.s3.errors import CircuitOpenError, TierOpenError
from kvtier_async.tiers.s3.fastget import FastGet
from kvtier_async.tiers.s3.requests import (
    DEFAULT_BACKOFF_S,
    Failure,
    Requests,
    classify,
    code_of,
    status_of,
)
from kvtier_async.tiers.s3.staging import Staging

__all__ = ["S3Tier", "S3TierStatistics", "from_config"]

log = get_logger(__name__)

_WARN_INTERVAL_S: Final = 10.0


@dataclass(frozen=True)
class S3TierStatistics(TierStatistics):
    """`TierStatistics` plus what the obj tier adds."""

    corrupt_objects: int = 0  # loads and lookups that found a corrupt object (deleted)
    retries: int = 0  # requests sent again after throttling, 5xx or a connection error
    circuit_state: str = "closed"  # closed, open or probing
    circuit_opens: int = 0
    timeouts: int = 0  # attempts (and probes) that got no complete answer in time
    lookup_timeouts: int = 0  # lookup keys answered as misses because the request timed out
    blocks_staged: int = 0  # blocks a lookup's GET fetched and verified, for the load
    bytes_staged: int = 0
    staged_loads: int = 0  # loads served from a staged block, with no request
    staged_evicted: int = 0  # staged blocks dropped unread to make room
    warnings_suppressed: int = 0  # rate-limited warning lines not logged


class S3Tier(SecondaryTier):
    """Blocks as objects in an S3-compatible bucket (see the package docstring).

    ``breaker_threshold``, ``breaker_timeouts``, ``breaker_open_s``, ``backoff_s`` (the first
    retry's maximum delay) and ``clock`` (the breaker's, monotonic seconds) are for tuning
    and tests; ``own_get`` False sends every GET through botocore (`fastget` is not used: a
    benchmark's reference).
    """

    kind = "obj"

    def __init__(
        self,
        name: str,
        ctx: TierContext,
        config: S3Config,
        *,
        breaker_threshold: int = DEFAULT_BREAKER_THRESHOLD,
        breaker_timeouts: int = DEFAULT_BREAKER_TIMEOUTS,
        breaker_open_s: float = DEFAULT_BREAKER_OPEN_S,
        backoff_s: float = DEFAULT_BACKOFF_S,
        clock: Callable[[], float] = time.monotonic,
        own_get: bool = True,
    ) -> None:
        super().__init__(name, ctx, config.max_concurrency, config.max_concurrency)
        self._own_get = own_get  # False: every GET through botocore (a benchmark's reference)
        self.config = config
        self._warn = RateLimited(log, _WARN_INTERVAL_S)
        self._stack: AsyncExitStack | None = None
        self._client: Any = None
        self._fast: FastGet | None = None  # GETs without botocore (a custom endpoint)
        self._closed = False
        self._conditional_put = True
        secrets = (config.access_key, config.secret_key, config.session_token)
        self._describe = Scrubber(*secrets).describe
        breaker = Breaker(breaker_threshold, breaker_open_s, clock, breaker_timeouts)
        probe = self._head_bucket
        self._requests = Requests(name, config, breaker, backoff_s, probe, self._describe)
        self._corrupt_objects = self._lookup_timeouts = 0  # what only this kind counts
        self._removed = Removed()  # keys of corrupt objects deleted, for take_removed
        self._staging = Staging(config.staging_bytes, ctx.block_bytes)

    def __repr__(self) -> str:
        where = self.config.endpoint_url or "AWS"
        return f"<S3Tier {self.name!r} s3://{self.config.bucket}/{self.config.prefix} at {where}>"

    @property
    def client(self) -> Any:
        """The aiobotocore S3 client while open (for instrumentation: ``client.meta.events``)."""
        if self._client is None:
            raise RuntimeError(f"{self!r} is not open")
        return self._client

    @property
    def fast_get(self) -> FastGet | None:
        """The GET path without botocore while open with a custom endpoint, else None (for
        instrumentation: ``fast_get.hooks``)."""
        return self._fast

    @property
    def staging(self) -> Staging:
        """The blocks lookups fetched for the loads that follow (read-only use)."""
        return self._staging

    def object_name(self, key: bytes) -> str:
        """The object key of block ``key``: ``<prefix>/`` + `block_relpath`."""
        relpath = block_relpath(self.ctx, key)
        return f"{self.config.prefix}/{relpath}" if self.config.prefix else relpath

    # -- life cycle ---------------------------------------------------------------------------

    async def open(self) -> None:
        """Create the client and probe the bucket; raise a `TierOpenError` that says why not."""
        if self._stack is not None or self._closed:
            raise RuntimeError(f"{self!r} is {'closed' if self._closed else 'open already'}")
        self._require_asyncio()
        await check_ca_bundle(self.config)
        stack = AsyncExitStack()
        try:
            session = make_session(self.config)
            self._client = await enter_client(stack, self._requests, session)
            await probe_bucket(self._requests, self._client)
            # AWS's own endpoint, or no credentials to sign with: GETs stay on botocore.
            if self._own_get and self.config.endpoint_override:
                credentials = await session.get_credentials()
                if credentials is not None:
                    region = self._client.meta.region_name
                    self._fast = await FastGet.open(stack, self.config, credentials, region)
        except BaseException:
            self._client = self._fast = None
            with anyio.move_on_after(self.config.timeout_s, shield=True):
                await stack.aclose()
            raise
        self._stack = stack
        if inline := self.config.inline_credentials:
            log.warning(
                "obj tier credentials are set inline in the config, where a host that logs its "
                "configuration shows them (vllm serve does); prefer the standard AWS credential "
                "chain: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment, a "
                "profile (AWS_PROFILE), or an instance role",
                tier=self.name,
                fields=inline,
            )
        log.info(
            "obj tier open",
            tier=self.name,
            bucket=self.config.bucket,
            prefix=self.config.prefix,
            endpoint=self.config.endpoint_url or "AWS",
            max_concurrency=self.config.max_concurrency,
        )

    async def aclose(self) -> None:
        """Close the client, waiting at most ``timeout_s``; idempotent."""
        self._closed = True
        self._staging.clear()
        stack, self._stack, self._client, self._fast = self._stack, None, None, None
        if stack is not None:
            with anyio.move_on_after(self.config.timeout_s, shield=True):
                await stack.aclose()

    def _require_asyncio(self) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise TierOpenError(
                f"obj tier {self.name!r} needs asyncio: aioboto3 (aiobotocore) runs on asyncio "
                "only; run the engine under asyncio to use it"
            ) from None

    # -- the contract -------------------------------------------------------------------------

    async def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        """GET (or HEAD) every key, up to ``max_concurrency`` at a time, staging what
        arrived for the load; an error or an open circuit answers False (a miss), never an
        exception."""
        self._require_open()
        try:
            await self._requests.admit()  # before the fan-out, so a due probe is sent once
        except CircuitOpenError:
            return [False] * len(keys)
        if not keys:
            return []
        return await self._fan_out(lambda i: self._lookup_one(keys[i]), len(keys))

    async def store(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        """PUT every block unless its object exists; `CircuitOpenError` while it is open."""
        self._check_batch(keys, blocks)
        await self._requests.admit()
        return await self._fan_out(lambda i: self._store_one(keys[i], blocks[i]), len(keys))

    async def load(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        """Copy every staged key into its block, GET and verify the others;
        `CircuitOpenError` while it is open."""
        self._check_batch(keys, blocks)
        await self._requests.admit()
        return await self._fan_out(lambda i: self._load_one(keys[i], blocks[i]), len(keys))

    def take_removed(self) -> list[bytes]:
        return self._removed.take()

    def statistics(self) -> S3TierStatistics:
        requests = self._requests
        put = "conditional PUT" if self._conditional_put else "HEAD then PUT"
        return S3TierStatistics(
            name=self.name,
            kind=self.kind,
            detail=(
                f"s3://{self.config.bucket}/{self.config.prefix} at "
                f"{self.config.endpoint_url or 'AWS'}; {put}; "
                f"max_concurrency={self.config.max_concurrency} retries={self.config.retries} "
                f"timeout_s={self.config.timeout_s:g} "
                f"lookup_timeout_s={self.config.lookup_timeout_s:g} "
                f"staging_bytes={self.config.staging_bytes}"
            ),
            corrupt_objects=self._corrupt_objects,
            retries=requests.retries,
            circuit_state=requests.breaker.state,
            circuit_opens=requests.breaker.opens,
            timeouts=requests.timeouts,
            lookup_timeouts=self._lookup_timeouts,
            blocks_staged=self._staging.staged,
            bytes_staged=self._staging.staged * self.ctx.block_bytes,
            staged_loads=self._staging.served,
            staged_evicted=self._staging.evicted,
            warnings_suppressed=self._warn.suppressed,
        )

    def _require_open(self) -> None:
        if self._client is None:
            raise RuntimeError(f"{self!r} is not open")

    def _check_batch(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> None:
        self._require_open()
        if len(keys) != len(blocks):
            raise ValueError(f"{len(keys)} keys but {len(blocks)} blocks")

    async def _fan_out(self, one: Callable[[int], Awaitable[bool]], count: int) -> list[bool]:
        """``[await one(i) for i in range(count)]``, up to ``max_concurrency`` at a time."""
        if count == 1:
            return [await one(0)]
        results = [False] * count
        indices = iter(range(count))

        async def worker() -> None:
            for i in indices:
                results[i] = await one(i)

        async with anyio.create_task_group() as tg:
            for _ in range(min(count, self.config.max_concurrency)):
                tg.start_soon(worker)
        return results

    # -- one key ------------------------------------------------------------------------------

    async def _lookup_one(self, key: bytes) -> bool:
        """GET one key into a staging buffer (a HEAD when none is free), within
        ``lookup_timeout_s``, retries included; False on any failure."""
        staging = self._staging
        if staging.touch(key):
            return True
        buffer = staging.acquire()
        if buffer is None:
            return await self._head_one(key)
        staged = False
        try:
            staged = await self._fetch(key, buffer)
        finally:
            if not staged:
                staging.release(buffer)
        return staged

    async def _fetch(self, key: bytes, buffer: bytearray) -> bool:
        """GET ``key`` into ``buffer`` and stage it: whether it is there, verified."""
        name = self.object_name(key)
        get = functools.partial(self._get_into, name, key, memoryview(buffer))
        try:
            await self._requests.send(get, budget_s=self.config.lookup_timeout_s)
        except CorruptBlockError as exc:
            await self._corrupt(name, key, exc)
            return False
        except Exception as exc:
            if status_of(exc) != 404:
                self._lookup_failed(key, exc)
            return False
        self._staging.stage(key, buffer)
        return True

    async def _head_one(self, key: bytes) -> bool:
        """HEAD one key within ``lookup_timeout_s``, retries included; False on any failure."""
        try:
            return await self._exists(self.object_name(key), self.config.lookup_timeout_s)
        except Exception as exc:
            self._lookup_failed(key, exc)
            return False

    def _lookup_failed(self, key: bytes, exc: Exception) -> None:
        if classify(exc) is Failure.TIMEOUT:
            self._lookup_timeouts += 1
        self._log_failure("obj lookup failed", key, exc)

    async def _store_one(self, key: bytes, block: memoryview) -> bool:
        header = memoryview(bytearray(HEADER_BYTES))
        pack_header(header, key, block)
        try:
            written = await self._put(self.object_name(key), header, block)
        except Exception as exc:
            self._log_failure("obj store failed", key, exc)
            return False
        if written:
            self.counters.written += 1
        else:
            self.counters.present += 1
        return True

    async def _load_one(self, key: bytes, block: memoryview) -> bool:
        staged = self._staging.take(key)
        if staged is not None:  # its lookup fetched and verified it: no request
            block[:] = staged
            self._staging.release(staged)
        else:
            name = self.object_name(key)
            try:
                await self._requests.send(functools.partial(self._get_into, name, key, block))
            except CorruptBlockError as exc:
                await self._corrupt(name, key, exc)
                return False
            except Exception as exc:
                if status_of(exc) == 404:
                    log.debug("obj load missed", tier=self.name, key=key.hex())
                else:
                    self._log_failure("obj load failed", key, exc)
                return False
        return True

    async def _corrupt(self, name: str, key: bytes, exc: CorruptBlockError) -> None:
        """Count a corrupt object and delete it; once deleted, `take_removed` reports it."""
        self._corrupt_objects += 1
        log.warning("obj corrupt object deleted", tier=self.name, key=key.hex(), reason=str(exc))
        if await self._delete(name):
            self._removed.add(key, REMOVED_DAMAGED)

    def _log_failure(self, event: str, key: bytes, exc: Exception) -> None:
        level = log.debug if isinstance(exc, CircuitOpenError) else self._warn
        level(event, tier=self.name, key=key.hex(), error=self._describe(exc))

    # -- requests -----------------------------------------------------------------------------

    async def _head_bucket(self) -> Any:
        return await self.client.head_bucket(Bucket=self.config.bucket)

    async def _exists(self, name: str, budget_s: float | None = None) -> bool:
        call = functools.partial(self.client.head_object, Bucket=self.config.bucket, Key=name)
        try:
            await self._requests.send(call, budget_s=budget_s)
        except boto_errors.ClientError as exc:
            if status_of(exc) == 404:
                return False
            raise
        return True

    async def _put(self, name: str, header: memoryview, block: memoryview) -> bool:
        """PUT header + block as ``name`` unless it exists; whether it was written."""

        async def put(**conditions: str) -> None:  # a fresh body for every attempt
            body = BlockFileBody(header, block)
            await self.client.put_object(
                Bucket=self.config.bucket, Key=name, Body=body, **conditions
            )

        if not self._conditional_put:
            if await self._exists(name):
                return False
            await self._requests.send(put)
            return True
        try:
            await self._requests.send(functools.partial(put, IfNoneMatch="*"))
        except boto_errors.ClientError as exc:
            if status_of(exc) == 412:
                return False
            if status_of(exc) != 501 and code_of(exc) != "NotImplemented":
                raise
            self._conditional_put = False
            log.warning("obj store refuses conditional PUT; using HEAD then PUT", tier=self.name)
            return await self._put(name, header, block)
        return True

    async def _get_into(self, name: str, key: bytes, block: memoryview) -> None:
        """GET ``name`` into ``block``, streaming; `CorruptBlockError` if it does not verify."""
        header = memoryview(bytearray(HEADER_BYTES))
        if self._fast is not None:
            await self._fast.get_into(name, (header, block))
        else:
            response = await self.client.get_object(Bucket=self.config.bucket, Key=name)
            stream = response["Body"]
            try:
                size, expected = response["ContentLength"], HEADER_BYTES + block.nbytes
                if size != expected:
                    raise CorruptBlockError(f"object is {size} bytes, expected {expected}")
                await read_into(stream, header)
                await read_into(stream, block)
            finally:
                stream.close()
        verify_block(header, key, block)

    async def _delete(self, name: str) -> bool:
        """Delete object ``name``; False (warned) if the store did not confirm it."""
        call = functools.partial(self.client.delete_object, Bucket=self.config.bucket, Key=name)
        try:
            await self._requests.send(call)
        except Exception as exc:
            self._warn("obj delete failed", tier=self.name, object=name, error=self._describe(exc))
            return False
        return True


def from_config(config: ObjTierConfig, name: str, ctx: TierContext) -> S3Tier:
    """Build an `S3Tier` from its validated config (the tier factory's ``"obj"`` entry)."""
    return S3Tier(name, ctx, S3Config.from_config(config))
