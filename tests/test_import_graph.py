"""The packages' layering, kept by a test: every import points down, and none go round.

Each of our packages sits in a layer; a module may import its own package and any
package in a lower layer, never a higher one, and never a sibling in its own layer
unless `SIBLING_ARROWS` lists that arrow. Imports are read statically with `ast` from
every `.py` under the layered packages, including imports inside functions and under
`if TYPE_CHECKING:`: a lazy import is still a dependency. A cycle of module-level
imports (those that run when the module loads) between any of our modules fails too,
with the cycle in the message.

Tests (`tests/`) are not layered: they may import anything but `tests.conftest`, which
holds only fixtures (the helpers are in tests/factories.py and tests/cluster_helpers.py).
"""

from __future__ import annotations

import ast
import graphlib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LAYERS = {
    "engine": 0,
    "proto": 1,
    "kv_transfer": 2,
    "worker": 3,
    "prefill_worker": 4,
    "decode_worker": 4,
    "cluster": 5,  # its root modules: config, config_flags, timeline, recoveries, package_version
    "cluster.control": 6,
    "cluster.flow": 6,
    "cluster.api": 7,
    "bench": 8,
    "cluster.cli": 9,
}
"""Unit (a package or subpackage) -> layer. A module belongs to the longest unit its
dotted name starts with: `cluster.flow.router` to `cluster.flow`, `cluster.config` to
`cluster`."""

SIBLING_ARROWS = {("cluster.flow", "cluster.control")}
"""Same-layer imports allowed, one way only: the data plane reads the control plane's
worker records (`WorkerInfo`) and `PDCluster` starts the `Controller`."""


@dataclass(frozen=True)
class Import:
    source: str
    """The importing module's dotted name."""
    target: str
    """The imported module of ours (a `from m import name` of a non-module is `m`)."""
    line: int
    at_load: bool
    """Runs when `source` loads: not inside a function, not under `if TYPE_CHECKING:`."""

    def where(self) -> str:
        return f"{self.source}:{self.line} imports {self.target}"


def unit_of(module: str) -> str:
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in LAYERS:
            return ".".join(parts[:end])
    raise KeyError(module)


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the layered packages."""
    found = {}
    for package in {unit.split(".")[0] for unit in LAYERS}:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(body: list[ast.stmt], at_load: bool):
    """Every statement under `body`, each with whether it runs when the module loads."""
    for node in body:
        yield node, at_load
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _statements(node.body, False)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _statements(node.body, False)
            yield from _statements(node.orelse, at_load)
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    yield from _statements([child], at_load)
                elif isinstance(child, ast.excepthandler | ast.match_case):
                    yield from _statements(child.body, at_load)


def _imported_names(node: ast.stmt, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        here = module.split(".") if is_package else module.split(".")[:-1]
        here = here[: len(here) - node.level + 1]
        base = ".".join([*here, base] if base else here)
    return [f"{base}.{alias.name}" if alias.name != "*" else base for alias in node.names]


def imports_of(root: Path) -> list[Import]:
    """Every import of one of our modules by one of our modules, statically."""
    files = module_files(root)
    ours = {unit.split(".")[0] for unit in LAYERS}
    found = []
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, at_load in _statements(tree.body, True):
            for name in _imported_names(node, module, path.name == "__init__.py"):
                if name.split(".")[0] not in ours:
                    continue
                target = name if name in files else name.rpartition(".")[0] or name
                found.append(Import(module, target, node.lineno, at_load))
    return found


def upward_imports(imports: list[Import]) -> list[str]:
    wrong = []
    for imp in imports:
        source, target = unit_of(imp.source), unit_of(imp.target)
        if source == target or LAYERS[target] < LAYERS[source]:
            continue
        if LAYERS[target] == LAYERS[source] and (source, target) in SIBLING_ARROWS:
            continue
        wrong.append(f"{imp.where()} (layer {LAYERS[source]} -> {LAYERS[target]})")
    return wrong


def load_cycle(imports: list[Import]) -> list[str] | None:
    """A cycle of module-level imports, as the modules along it, or None."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.at_load and imp.target != imp.source:
            graph.setdefault(imp.source, set()).add(imp.target)
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as cycle:
        return list(cycle.args[1])
    return None


def test_every_import_points_down_a_layer():
    wrong = upward_imports(imports_of(ROOT))
    assert not wrong, "imports of a higher layer:\n" + "\n".join(wrong)


def test_no_module_level_import_cycle():
    cycle = load_cycle(imports_of(ROOT))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_engine_imports_nothing_of_ours():
    outside = [
        imp.where()
        for imp in imports_of(ROOT)
        if unit_of(imp.source) == "engine" and unit_of(imp.target) != "engine"
    ]
    assert outside == []


def test_no_test_imports_conftest():
    """Helpers live in tests/factories.py and tests/cluster_helpers.py; conftest only
    holds fixtures, which pytest injects by name."""
    importers = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = _imported_names(node, f"tests.{path.stem}", False)
            if any(
                name == "tests.conftest" or name.startswith("tests.conftest.") for name in names
            ):
                importers.append(f"{path.name}:{node.lineno}")
    assert importers == []


@pytest.fixture
def fake_tree(tmp_path) -> Path:
    """A copy of the layering in miniature: engine below worker below cluster.cli."""
    for package in (
        "engine",
        "worker",
        "cluster",
        "cluster/flow",
        "cluster/control",
        "cluster/cli",
    ):
        (tmp_path / package).mkdir(parents=True, exist_ok=True)
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "engine" / "core.py").write_text("import os\n")
    (tmp_path / "worker" / "actor.py").write_text("from engine.core import os\n")
    (tmp_path / "cluster" / "flow" / "router.py").write_text(
        "from cluster.control import records\nfrom cluster.config import X\n"
    )
    (tmp_path / "cluster" / "control" / "records.py").write_text("from worker import actor\n")
    (tmp_path / "cluster" / "config.py").write_text("X = 1\n")
    (tmp_path / "cluster" / "cli" / "main.py").write_text("from cluster.flow.router import X\n")
    return tmp_path


def test_the_checks_pass_a_downward_tree(fake_tree):
    imports = imports_of(fake_tree)
    assert Import("cluster.flow.router", "cluster.control.records", 1, True) in imports
    assert upward_imports(imports) == []
    assert load_cycle(imports) is None


def test_a_lazy_upward_import_fails(fake_tree):
    (fake_tree / "engine" / "core.py").write_text(
        "def build():\n    from worker.actor import os\n    return os\n"
    )
    assert upward_imports(imports_of(fake_tree)) == [
        "engine.core:2 imports worker.actor (layer 0 -> 3)"
    ]


def test_a_type_checking_import_of_a_sibling_the_wrong_way_fails(fake_tree):
    (fake_tree / "cluster" / "control" / "records.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cluster.flow import router\n"
    )
    assert upward_imports(imports_of(fake_tree)) == [
        "cluster.control.records:3 imports cluster.flow.router (layer 6 -> 6)"
    ]


def test_a_module_level_cycle_is_reported_with_its_modules(fake_tree):
    (fake_tree / "cluster" / "config.py").write_text("from cluster.flow.router import Y\nX = 1\n")
    cycle = load_cycle(imports_of(fake_tree))
    assert cycle is not None
    assert set(cycle) == {"cluster.config", "cluster.flow.router"}
    assert cycle[0] == cycle[-1]


def test_a_cycle_closed_only_inside_a_function_is_not_a_load_cycle(fake_tree):
    (fake_tree / "cluster" / "config.py").write_text(
        "def late():\n    from cluster.flow.router import Y\n    return Y\n"
    )
    assert load_cycle(imports_of(fake_tree)) is None
