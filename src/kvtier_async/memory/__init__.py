"""CPU-tier memory: the shared mmap region that backs the primary (CPU) tier."""

from kvtier_async.memory.region import (
    PAGE_SIZE,
    RegionClaimedError,
    RegionError,
    RegionInUseError,
    RegionLayoutError,
    SharedRegion,
    StaleRegionError,
    close_region,
    find_stale_regions,
    region_path,
    remove_stale_regions,
)

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
