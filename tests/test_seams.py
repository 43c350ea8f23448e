"""No module of the package reaches into another's private names.

A module's underscore names (``_resolve``, ``_path``, ``memory/_create.py``) are its own:
another module that needs one gets a public seam instead (`JobHandle.settle`,
`TierConfig.at`, `kvtier_async.memory.owner`, `kvtier_async.tiers.fs.files.python_io`).
This reads every module under ``src/`` (the tests may reach in: that is what seams for
fault injection are for) and fails on

- an import of a private module or name from outside the package that holds it
  (``kvtier_async/memory/_owner.py`` is importable from ``kvtier_async/memory/`` only; a
  private module at the top, ``kvtier_async/_log.py``, from anywhere in the package);
- an attribute ``x._name`` read, written or deleted, where ``x`` is not ``self`` or ``cls``
  and the module does not define ``_name`` itself (a class of its own reading another
  instance's ``_value`` is its own business);

except for the other projects' private names in `THIRD_PARTY`, each with why we read it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
OURS = ("kvtier_async", "kernels")

# (module, name): the private names of other projects we read, and why. Never a write.
THIRD_PARTY = {
    # vLLM's metric names: ours must be the same series (the connector's metrics doc).
    ("kvtier_async.integrations.vllm.metrics", "_ConnectorMetricName"): "vLLM's metric names",
    ("kvtier_async.integrations.vllm.metrics", "_MetricType"): "vLLM's metric names",
    ("kvtier_async.integrations.vllm.metrics", "_TransferMetricName"): "vLLM's metric names",
    # The bench reports which of vLLM's fs I/O paths it compared with.
    ("kvtier_async.bench.fs_kit", "_HAS_FSIO_C"): "vLLM's fs tier: C or Python",
    ("kvtier_async.bench.gpu", "_sleep"): "torch.cuda's spin kernel, to hold a stream busy",
    ("kvtier_async.bench.s3server", "_server"): "moto leaves its listening socket open",
    ("kvtier_async.transfer.plan", "_handle"): "ctypes: a PyDLL over the loaded library",
    ("kvtier_async.fleet.router", "_asdict"): "a NamedTuple's public method",
    ("kvtier_async.fleet.service", "_asdict"): "a NamedTuple's public method",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _modules() -> list[tuple[str, Path]]:
    found = []
    for top in OURS:
        for path in sorted((SRC / top).rglob("*.py")):
            parts = path.relative_to(SRC).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found.append((".".join(parts), path))
    return found


def _package(module: str, path: Path) -> str:
    """The package a module lives in (itself, for a package's ``__init__``)."""
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _defined(tree: ast.Module) -> set[str]:
    """Every name the module defines: functions, classes, assigned names and attributes,
    ``__slots__`` entries."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
        ):
            names |= {
                c.value
                for c in ast.walk(node.value)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            }
    return names


def _owner_package(imported: str) -> str | None:
    """For a module path with a private part (``a.b._c.d``), the package its privacy is
    scoped to (``a.b``); None when every part is public."""
    parts = imported.split(".")
    for i, part in enumerate(parts):
        if _private(part):
            return ".".join(parts[:i])
    return None


def _inside(package: str, scope: str) -> bool:
    return package == scope or package.startswith(scope + ".")


def _reach_ins(module: str, path: Path, source: str | None = None) -> list[str]:
    """What module ``module`` (at ``path``; its text ``source``, else the file's) reaches."""
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    package, defined, found = _package(module, path), _defined(tree), []

    def allowed(name: str) -> bool:
        return (module, name) in THIRD_PARTY

    for node in ast.walk(tree):
        where = f"{path.relative_to(SRC)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom):
            origin = node.module or ""
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join([*base, *([origin] if origin else [])])
            scope = _owner_package(origin)
            if scope is not None and not _inside(package, scope):
                found.append(f"{where}: imports the private module {origin}")
            for alias in node.names:
                if not _private(alias.name) or allowed(alias.name):
                    continue
                # `from pkg import _mod` (a private submodule or name of pkg): pkg's own.
                if not _inside(package, origin):
                    found.append(f"{where}: imports {origin}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                scope = _owner_package(alias.name)
                if scope is not None and not _inside(package, scope):
                    found.append(f"{where}: imports the private module {alias.name}")
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in defined or allowed(node.attr):
                continue
            verb = {ast.Store: "writes", ast.Del: "deletes"}.get(type(node.ctx), "reads")
            found.append(f"{where}: {verb} {ast.unparse(node)}")
    return found


def test_no_module_reaches_into_another() -> None:
    found = [line for module, path in _modules() for line in _reach_ins(module, path)]
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_every_allowance_is_still_needed() -> None:
    """An entry of `THIRD_PARTY` whose module no longer reads the name goes."""
    used = set()
    for module, path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                used.add((module, node.attr))
            elif isinstance(node, ast.ImportFrom):
                used |= {(module, alias.name) for alias in node.names}
    assert set(THIRD_PARTY) <= used, sorted(set(THIRD_PARTY) - used)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from kvtier_async.memory._owner import read_owner\n", "private module"),
        ("from kvtier_async.tiers.fs import files\nfiles._native_fsio = None\n", "writes"),
        ("def f(handle):\n    handle._resolve(None)\n", "reads handle._resolve"),
        ("from kvtier_async.memory import _create\n", "imports kvtier_async.memory._create"),
    ],
)
def test_the_check_finds_a_reach_in(source: str, expected: str) -> None:
    """The check itself can fail: a module outside ``memory`` and ``tiers`` doing each."""
    path = SRC / "kvtier_async" / "ops" / "probe_for_test_seams.py"  # never written
    found = _reach_ins("kvtier_async.ops.probe_for_test_seams", path, source)
    assert any(expected in line for line in found), found
