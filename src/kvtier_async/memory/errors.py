"""The errors of the shared CPU region (`kvtier_async.memory.region`): one base class,
`RegionError`, and a subclass for each case a caller may want to tell apart."""

from __future__ import annotations

__all__ = [
    "RegionClaimedError",
    "RegionError",
    "RegionInUseError",
    "RegionLayoutError",
    "StaleRegionError",
]


class RegionError(RuntimeError):
    """A shared region could not be created, joined or used."""


class RegionLayoutError(RegionError):
    """An existing region file was created with a different size or layout."""


class StaleRegionError(RegionError):
    """An existing region file belongs to a creator that is no longer running, and another
    live process still maps it, so it cannot be reclaimed."""


class RegionClaimedError(RegionError):
    """Another live handle already holds this place in the region (same ``instance_id``,
    same role and rank), or the region belongs to another engine (another token)."""


class RegionInUseError(RegionError, BufferError):
    """The mapping cannot be unmapped: views of it are still alive."""
