"""The package's layers: no module imports from a layer above its own.

    foundation  <- ledger, memory, events  <- engine  <- tiers, transfer, kernels
                <- api, integrations, vllm  <- cli, demo, ops, bench, tiny_model

A module may import its own layer and the layers below it. `LAYERS` places every top-level
module and subpackage of ``src/kvtier_async`` (and ``src/kernels``, installed as
``kvtier_async.kernels``): the
foundation holds what everything may use (logging, the native-helper builder, the CUDA
runtime loader, config parsing, the version); ``memory`` (the shared CPU region) sits with
the sans-I/O ledger because tiers, transfers and tools build on it and it builds on nothing
of ours; ``events`` turns ledger events into the public KV events. ``ops`` and ``bench``
are command-line tools, at the level of ``cli``, and so is ``tiny_model`` (the model that
``kvtier tiny-model`` writes and the benchmarks serve).

The walk reads every ``import`` and ``from ... import`` of the source with `ast`, relative
imports and imports under ``if TYPE_CHECKING:`` included (a type-only upward import is still
an upward dependency). No imports go round in a circle either, within a layer or across
layers (`import_cycles`; lazy and type-only ones count too). Imports through `importlib` by
string are not seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "kvtier_async",
        "_log",
        "_native",
        "_cudart",
        "_safefile",
        "_beneath",
        "_extras",
        "_mounts",
        "config",
        "defaults",
    ),
    ("ledger", "memory", "events"),
    ("engine",),
    ("tiers", "transfer", "kernels"),
    ("api", "assembly", "integrations", "metrics", "settings", "vllm", "fleet"),
    ("cli", "demo", "doctor", "ops", "bench", "tiny_model"),
)
LEVEL = {part: level for level, parts in enumerate(LAYERS) for part in parts}


def part_of(module: str) -> str | None:
    """The `LAYERS` entry of a dotted module name (None: not ours)."""
    head, _, rest = module.partition(".")
    if head != "kvtier_async":
        return None
    return rest.partition(".")[0] or "kvtier_async"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[0] == "kernels":  # src/kernels/ installs as kvtier_async.kernels (pyproject.toml)
        parts.insert(0, "kvtier_async")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in ``tree``, relative ones resolved."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            # `from kvtier_async import api` imports kvtier_async.api
            found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]
    return found


def violations(source: str, module: str, *, is_package: bool = False) -> list[str]:
    """Each import of ``source`` (the text of ``module``) that reaches above its layer."""
    own = part_of(module)
    assert own is not None and own in LEVEL, f"{module} is in no layer: add it to LAYERS"
    bad = []
    for line, name in imported(ast.parse(source), module, is_package):
        target = _target_part(name)
        if target is not None and LEVEL[target] > LEVEL[own]:
            bad.append(
                f"{module}:{line} imports {name} ({target}, layer {LEVEL[target]}) "
                f"from {own} (layer {LEVEL[own]})"
            )
    return bad


def _target_part(name: str) -> str | None:
    """The layer entry an imported name belongs to; a name of the root package's namespace
    (``from kvtier_async import __version__``) is the root itself."""
    part = part_of(name)
    if part is None:
        return None
    if part not in LEVEL and name.count(".") == 1:
        return "kvtier_async"  # an attribute of the root package, not a module
    assert part in LEVEL, f"{name} is in no layer: add it to LAYERS"
    return part


def sources() -> list[Path]:
    paths = [*(SRC / "kvtier_async").rglob("*.py"), *(SRC / "kernels").rglob("*.py")]
    return sorted(paths)


def test_every_module_is_placed_in_a_layer() -> None:
    unplaced = {part_of(module_name(p)) for p in sources()} - set(LEVEL)
    assert not unplaced, f"not in LAYERS: {sorted(p for p in unplaced if p)}"


def test_no_module_imports_from_a_higher_layer() -> None:
    found = []
    for path in sources():
        found += violations(
            path.read_text(), module_name(path), is_package=path.name == "__init__.py"
        )
    assert not found, "imports against the layering:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("kvtier_async.engine.engine", "from kvtier_async.tiers.base import SecondaryTier"),
        ("kvtier_async.engine.engine", "from ..tiers import base"),
        ("kvtier_async.ledger.keys", "import kvtier_async.api"),
        ("kvtier_async.memory.region", "from kvtier_async import api"),
        ("kvtier_async.transfer.handlers", "if TYPE_CHECKING:\n    from kvtier_async import cli"),
        ("kvtier_async.api", "from kvtier_async.bench import kits"),
        ("kvtier_async._log", "from kvtier_async.engine import Engine"),
    ],
)
def test_an_upward_import_is_reported_with_its_place(module: str, source: str) -> None:
    (message,) = violations(source, module)
    assert message.startswith(f"{module}:")
    assert f"from {part_of(module)}" in message


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("kvtier_async.api", "from kvtier_async.tiers.base import SecondaryTier"),
        ("kvtier_async.api", "from .engine import Engine"),
        ("kvtier_async.tiers.fs.tier", "from ..base import SecondaryTier"),
        ("kvtier_async.cli", "from kvtier_async import __version__"),
        ("kvtier_async.transfer.handlers", "from kvtier_async.kernels.swap_blocks import MIN_JOBS"),
        ("kvtier_async.engine.engine", "import anyio\nfrom kvtier_async.ledger import JobKind"),
    ],
)
def test_imports_down_or_across_a_layer_pass(module: str, source: str) -> None:
    assert violations(source, module) == []


def import_cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected parts of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[tuple[str, ...]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = []
            while True:
                top = stack.pop()
                part.append(top)
                if top == node:
                    break
            if len(part) > 1:
                found.append(tuple(sorted(part)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def package_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports, at import time or later (in a function, under
    ``TYPE_CHECKING``: a lazy import hides a cycle, it does not remove it). An import of a
    package that holds the importer is left out: Python has started that package already."""
    modules = {module_name(path): path for path in sources()}
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        targets = set()
        for _, name in imported(tree, module, path.name == "__init__.py"):
            target = name if name in modules else name.rpartition(".")[0]
            if target in modules and target != module and not module.startswith(target + "."):
                targets.add(target)
        graph[module] = targets
    return graph


def test_no_import_cycles() -> None:
    assert import_cycles(package_graph()) == []


def test_an_import_cycle_is_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert import_cycles(graph) == [("a", "b", "c")]
