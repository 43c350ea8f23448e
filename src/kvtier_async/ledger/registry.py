"""Policies by name: the built-in ones (``lru``, ``arc``, ``prefix``, ``reuse``, ``sieve``,
``s3fifo``, ``tinylfu``, ``adaptive``) and any ``package.module:ClassName`` that names a
`CachePolicy` subclass.

Apart from the policies so that each policy module builds only on `policy` (the base
classes) and nothing imports in a circle.
"""

from __future__ import annotations

import importlib

from .adaptive import AdaptivePolicy
from .arc import ARCPolicy
from .lru import LRUPolicy
from .policy import CachePolicy, SlotTable
from .prefix_policy import PrefixPolicy
from .reuse_policy import ReusePolicy
from .s3fifo import S3FIFOPolicy
from .sieve import SievePolicy
from .tinylfu import TinyLFUPolicy

__all__ = ["BUILTIN_POLICIES", "check_policy", "make_policy"]

_BUILTIN: dict[str, type[CachePolicy]] = {
    "adaptive": AdaptivePolicy,
    "lru": LRUPolicy,
    "arc": ARCPolicy,
    "prefix": PrefixPolicy,
    "reuse": ReusePolicy,
    "s3fifo": S3FIFOPolicy,
    "sieve": SievePolicy,
    "tinylfu": TinyLFUPolicy,
}

#: the built-in policies' names
BUILTIN_POLICIES: tuple[str, ...] = tuple(_BUILTIN)


def make_policy(name: str, capacity: int, table: SlotTable) -> CachePolicy:
    """Build a policy by name (one of the built-in ones, see the module docstring) or by
    ``package.module:ClassName``."""
    cls = _BUILTIN.get(name)
    if cls is None:
        try:
            cls = _import_policy(name)
        except ValueError as exc:
            raise ValueError(f"eviction_policy {exc}") from exc.__cause__
    return cls(capacity, table)


def check_policy(name: str) -> str:
    """``name`` if it names a policy (built in, or a `CachePolicy` subclass that imports);
    else `ValueError` saying what is allowed. For config validation, before any state."""
    if name not in _BUILTIN:
        _import_policy(name)
    return name


def _import_policy(path: str) -> type[CachePolicy]:
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"must be one of {sorted(_BUILTIN)} or 'package.module:ClassName', got {path!r}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:  # ModuleNotFoundError included
        raise ValueError(f"{path!r}: module {module_name!r} cannot be imported ({exc})") from exc
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, CachePolicy)):
        raise ValueError(f"{path!r} does not name a CachePolicy subclass")
    return cls
