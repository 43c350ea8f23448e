"""The obj tier: one object per block in an S3-compatible store (AWS S3, MinIO, Ceph, moto).

Block ``key`` is object ``<prefix>/`` + `block_relpath` in ``bucket``, its body a block file
(the fs tier's format, so the two are interchangeable), PUT with ``If-None-Match: *`` and
found by a GET that stages the block for its load, verified before a load reports success.
Every request has a total deadline, retries within a budget and goes through a circuit
breaker, so a dead or silent endpoint costs the engine little and never hangs it. Secrets
never show. Each module's docstring tells its part:

- `tier`: `S3Tier` (life cycle, the tier contract, one request per key), its statistics.
- `config`: `S3Config` (vLLM's fields and ours), `Secret`, the scrubbing of error texts.
- `requests`: deadlines, retries, failure classes, the breaker's gate and probe.
- `breaker`: the circuit breaker's bookkeeping.
- `staging`: the blocks a lookup's GET fetched, kept for the load that follows.
- `fastget`: the GET itself at a custom endpoint, signed (SigV4) and sent without botocore.
- `client`: the aiobotocore client (opening it, the bucket probe's diagnosis, the Expect hook)
  and the block bodies going up and coming down.
- `errors`: the exceptions, `TierOpenError` and the ones that say what to fix.
"""

from kvtier_async.tiers.s3.breaker import (
    DEFAULT_BREAKER_OPEN_S,
    DEFAULT_BREAKER_THRESHOLD,
    DEFAULT_BREAKER_TIMEOUTS,
)
from kvtier_async.tiers.s3.config import (
    DEFAULT_LOOKUP_TIMEOUT_S,
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_RETRIES,
    DEFAULT_STAGING_BYTES,
    DEFAULT_TIMEOUT_S,
    ObjTierConfig,
    S3Config,
    Secret,
)
from kvtier_async.tiers.s3.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    CircuitOpenError,
    EndpointUnreachableError,
    RequestTimeoutError,
    TierOpenError,
)
from kvtier_async.tiers.s3.requests import DEFAULT_BACKOFF_S
from kvtier_async.tiers.s3.tier import S3Tier, S3TierStatistics, from_config

__all__ = [
    "DEFAULT_BACKOFF_S",
    "DEFAULT_BREAKER_OPEN_S",
    "DEFAULT_BREAKER_THRESHOLD",
    "DEFAULT_BREAKER_TIMEOUTS",
    "DEFAULT_LOOKUP_TIMEOUT_S",
    "DEFAULT_MAX_CONCURRENCY",
    "DEFAULT_RETRIES",
    "DEFAULT_STAGING_BYTES",
    "DEFAULT_TIMEOUT_S",
    "AccessDeniedError",
    "BucketNotFoundError",
    "CircuitOpenError",
    "EndpointUnreachableError",
    "ObjTierConfig",
    "RequestTimeoutError",
    "S3Config",
    "S3Tier",
    "S3TierStatistics",
    "Secret",
    "TierOpenError",
    "from_config",
]
