"""CPU-tier memory: the shared mmap region that backs the primary (CPU) tier.

`region` is the mapping (`SharedRegion`), `errors` its errors, `stale` the clean-up of dead
creators' files; the private modules create, claim and reclaim region files (see `region`).
"""

from kvtier_async.memory.errors import (
    RegionClaimedError,
    RegionError,
    RegionInUseError,
    RegionLayoutError,
    StaleRegionError,
)
from kvtier_async.memory.region import PAGE_SIZE, SharedRegion, close_region, region_path
from kvtier_async.memory.stale import find_stale_regions, remove_stale_regions

__all__ = [
    "PAGE_SIZE",
    "RegionClaimedError",
    "RegionError",
    "RegionInUseError",
    "RegionLayoutError",
    "SharedRegion",
    "StaleRegionError",
    "close_region",
    "find_stale_regions",
    "region_path",
    "remove_stale_regions",
]
