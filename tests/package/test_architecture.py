"""Architecture rules for the autopar sources: a layered import graph, no cycles, small files.

Every module of the installed packages is parsed with :mod:`ast` (nothing is
imported) and every import it contains counts: module level, inside
functions, under ``if TYPE_CHECKING:``. File paths map to module names through
``[tool.setuptools.package-dir]`` in ``pyproject.toml`` (``passes/`` is
``autopar.passes``, ``cost_models/`` is ``autopar.cost_models``), so the rules
follow the packaging as it changes.
"""

from __future__ import annotations

import ast
import itertools
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 600

# Module (or package prefix) → level. A module may import only modules of its
# own level or lower; the longest matching prefix decides a module's level.
LEVELS: dict[str, int] = {
    "autopar.errors": 0,
    "autopar.units": 0,
    "autopar.quiet": 0,  # the CLI's logging filters, for the processes it starts too (runtime ranks)
    "autopar.cost_models": 1,
    "autopar.mesh": 2,
    "autopar.choice": 2,
    "autopar.graph": 2,
    "autopar.tp_style": 2,  # a tensor-parallel style: what capture's rules make and a layer lists
    "autopar.experts": 2,
    "autopar.batch_coupling": 2,
    "autopar.float8": 2,
    "autopar.plan": 2,
    "autopar.plan_table": 2,
    "autopar.pins": 2,
    "autopar.contract": 2,
    "autopar.contract_cp": 2,
    "autopar.contract_compile": 2,
    "autopar.contract_loss": 2,
    "autopar.admission": 2,  # every reason a plan cannot run here: read by the planner and the runtime
    "autopar.contract_hsdp": 2,
    "autopar.loss_head": 2,
    "autopar.inputs": 2,
    "autopar.stacks": 2,
    "autopar.sharding": 3,
    "autopar.capturing": 4,
    "autopar.planning": 4,
    "autopar.passes": 5,
    "autopar.data": 5,  # feeds the runtime; imports nothing above the errors
    "autopar.runtime": 6,
    "autopar.tools": 7,
}
# The root package is a lazy (PEP 562) export map: it has no level of its own.
EXEMPT = {"autopar"}


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    is_package: bool

    @property
    def rel(self) -> str:
        return self.path.relative_to(ROOT).as_posix()


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int


@cache
def _package_dir() -> dict[str, str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return dict(config["tool"]["setuptools"]["package-dir"])


def _longest_prefix(name: str, prefixes) -> str | None:
    return max((p for p in prefixes if name == p or name.startswith(p + ".")), key=len, default=None)


@cache
def modules() -> dict[str, Module]:
    """Every source module under the package-dir folders, by its installed name."""
    package_dir = _package_dir()
    found: dict[str, Module] = {}
    for package, folder in package_dir.items():
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            if any(p == "__pycache__" or p.startswith(".") for p in parts):
                continue
            is_package = parts[-1] == "__init__"
            name = ".".join((package, *(parts[:-1] if is_package else parts)))
            if _longest_prefix(name, package_dir) != package:
                continue  # that name is installed from another folder of package-dir
            found[name] = Module(name, path, is_package)
    return found


def level_of(name: str) -> int | None:
    prefix = _longest_prefix(name, LEVELS)
    return None if prefix is None else LEVELS[prefix]


def _root_exports() -> dict[str, str]:
    """The lazy export map of ``autopar/__init__.py``: ``from autopar import Plan`` imports autopar.plan."""
    tree = ast.parse(modules()["autopar"].path.read_text())
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        if isinstance(target, ast.Name) and target.id == "_EXPORTS" and node.value is not None:
            return ast.literal_eval(node.value)
    return {}


def imports_in(source: str, module: str, is_package: bool, known: set[str],
               exports: dict[str, str] | None = None) -> list[tuple[str, int]]:
    """(autopar module imported, line) for every import in ``source``, wherever it sits.

    ``from X import Y`` imports ``X.Y`` when that is a module, else ``X``;
    relative imports resolve against ``module``; ``importlib.import_module``
    with a constant name counts too. A name that is not a module resolves to
    its longest known prefix.
    """
    exports = exports or {}
    package = module if is_package else module.rpartition(".")[0]
    raw: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            raw += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                if node.level - 1 >= len(parts):
                    raise ValueError(f"{module}:{node.lineno}: relative import beyond the top-level package")
                base = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    raw.append((sub, node.lineno))
                elif base == "autopar" and alias.name in exports:
                    raw.append((exports[alias.name], node.lineno))
                else:
                    raw.append((base, node.lineno))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name | ast.Attribute)
            and (node.func.id if isinstance(node.func, ast.Name) else node.func.attr) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            raw.append((node.args[0].value, node.lineno))
    found = []
    for name, line in raw:
        if name == "autopar" or name.startswith("autopar."):
            target = name if name in known else _longest_prefix(name, known)
            if target is not None:
                found.append((target, line))
    return found


@cache
def import_graph() -> tuple[nx.DiGraph, tuple[Import, ...]]:
    mods = modules()
    known = set(mods)
    exports = _root_exports()
    graph = nx.DiGraph()
    graph.add_nodes_from(known)
    edges = []
    for mod in mods.values():
        for target, line in imports_in(mod.path.read_text(), mod.name, mod.is_package, known, exports):
            edges.append(Import(mod.name, target, line))
            graph.add_edge(mod.name, target)
    return graph, tuple(edges)


# --------------------------------------------------------------------------- tests


def test_walker_sees_every_kind_of_import():
    """The rules below are vacuous if the walk misses modules or imports: check it on known cases."""
    mods = modules()
    for name in ("autopar.capturing.trace", "autopar.passes.stage_split", "autopar.cost_models.hardware"):
        assert name in mods, f"{name} not found: the package-dir mapping in pyproject.toml is not followed"
    assert mods["autopar.passes"].path == ROOT / "passes" / "__init__.py"
    known = {"autopar", "autopar.pkg", "autopar.pkg.a", "autopar.pkg.b", "autopar.graph", "autopar.plan"}
    source = (
        "from typing import TYPE_CHECKING\n"
        "import torch\n"
        "from . import b\n"  # submodule via relative import
        "if TYPE_CHECKING:\n"
        "    from autopar.graph import Layer\n"
        "def f():\n"
        "    from autopar import Plan\n"  # lazy export of the root
        "    import autopar.pkg.b.Missing\n"  # resolves to the module that holds it
    )
    found = {t for t, _ in imports_in(source, "autopar.pkg.a", False, known, {"Plan": "autopar.plan"})}
    assert found == {"autopar.pkg.b", "autopar.graph", "autopar.plan"}
    assert [t for t, _ in imports_in("from .a import x\n", "autopar.pkg", True, known)] == ["autopar.pkg.a"]


def test_every_module_has_a_level():
    """A new module must be placed on a level (LEVELS here), so the layering rule covers it."""
    unplaced = sorted(f"{m.name} ({m.rel})" for m in modules().values()
                      if m.name not in EXEMPT and level_of(m.name) is None)
    assert not unplaced, "modules without a level, add them to LEVELS in tests/package/test_architecture.py:\n  " + \
        "\n  ".join(unplaced)


def test_no_import_cycles():
    """No two autopar modules import each other, directly or through others (cycles break partial imports)."""
    graph, _ = import_graph()
    cycles = []
    for cycle in itertools.islice(nx.simple_cycles(graph), 200):
        start = cycle.index(min(cycle))
        cycles.append(cycle[start:] + cycle[:start])
    assert not cycles, f"{len(cycles)} import cycle(s):\n  " + "\n  ".join(
        str(c + [c[0]]) for c in sorted(cycles))


def test_imports_point_down_the_levels():
    """A module imports only modules of its own level or lower (errors → cost models → ... → tools)."""
    _, edges = import_graph()
    mods = modules()
    offenders = []
    for e in edges:
        if e.importer in EXEMPT or e.imported in EXEMPT:
            continue
        a, b = level_of(e.importer), level_of(e.imported)
        if a is not None and b is not None and b > a:
            offenders.append(
                f"{e.importer} (level {a}) imports {e.imported} (level {b})  [{mods[e.importer].rel}:{e.line}]")
    assert not offenders, f"{len(offenders)} import(s) of a higher level:\n  " + "\n  ".join(sorted(offenders))


def test_source_files_stay_small():
    """No package source file exceeds MAX_LINES lines: split a module before it becomes hard to review."""
    big = []
    for mod in modules().values():
        n = len(mod.path.read_text().splitlines())
        if n > MAX_LINES:
            big.append((n, mod.rel))
    assert not big, f"source files over {MAX_LINES} lines:\n  " + "\n  ".join(
        f"{rel}: {n} lines" for n, rel in sorted(big, reverse=True))
