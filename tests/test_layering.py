"""The library's layers: folders are layers, no module imports another's private names, nothing
imports upwards, library code never imports the command line, and no chain of imports leads from a
module back to itself."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "evolm_lib"
# bottom to top, by top-level module or folder; a module may import from its own layer or below
LAYERS = [
    # pure pieces: maths, data, rewards; nothing here touches an engine, a run folder or a model
    {"seeds", "types", "divergence", "es", "zo", "tasks", "grpo", "metrics", "stats", "clock"},
    # settings, adapters, model folders, run folders (and report_to's copies of their rows), what to do with many (grid), process environment and its stop signals
    {"config", "config_checks", "parameters", "lora", "models", "runs", "grid", "reporting", "env", "paths", "quiet", "stop_signals"},
    # engines behind one protocol, and what is measured through them
    {"engines", "preflight", "scoring", "throughput"},
    # runs (ES, GRPO, the loop they share) and what drives or reads many runs
    {"train", "analysis", "batch", "sweep", "tune", "benchmark", "geometry"},
    # on top: widgets and figures, the evolm command
    {"viz", "cli"},
]
PURE = {"es", "grpo", "zo", "tasks", "stats"}


def _layer(module: str) -> int:
    top = module.split(".")[0]
    for index, layer in enumerate(LAYERS):
        if top in layer:
            return index
    raise AssertionError(f"evolm_lib.{module} is in no layer of tests/test_layering.py: add it")


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).with_suffix("")
        parts = [p for p in relative.parts if p != "__init__"]
        if parts and parts[-1] != "__main__":
            yield ".".join(parts), path, path.name == "__init__.py"


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` blocks: imports for annotations, never run."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            inside.update(id(child) for statement in node.body for child in ast.walk(statement))
    return inside


def _imports(module: str, path: Path, is_package: bool, runtime_only: bool = False):
    """(imported evolm_lib module, names) of every import in a file, lazy ones included (with
    ``runtime_only``, not those under ``if TYPE_CHECKING:``); the forms ``from .. import x``,
    ``from evolm_lib import x`` and ``import evolm_lib.x`` name module x."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    tree = ast.parse(path.read_text())
    skipped = _type_checking_only(tree) if runtime_only else set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("evolm_lib."):
                    yield alias.name.removeprefix("evolm_lib."), []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == "evolm_lib" or node.module.startswith("evolm_lib.")):
                target = node.module.removeprefix("evolm_lib").lstrip(".")
            else:
                continue
            names = [alias.name for alias in node.names]
            if target:
                yield target, names
            else:  # from .. import zo, from evolm_lib import es: each name is a module
                for name in names:
                    yield name, []


MODULES = list(_modules())


def _import_graph(modules) -> dict[str, set[str]]:
    """Module -> the evolm_lib modules its import statements name, lazy ones included (imports
    for annotations only, under ``if TYPE_CHECKING:``, are never run and tie nothing).

    ``from . import x`` names submodule x where there is one, else the package itself (x is then a
    name its ``__init__`` defines). Python runs a package's ``__init__`` before any of its
    submodules, but that is no edge here: every package whose ``__init__`` re-exports a submodule
    would otherwise form a cycle with it. The ``__init__``'s own imports are the package's edges."""
    names = {module for module, _, _ in modules}
    graph = {}
    for module, path, is_package in modules:
        edges = set()
        for target, imported in _imports(module, path, is_package, runtime_only=True):
            submodules = [f"{target}.{name}" for name in imported if f"{target}.{name}" in names]
            edges.update(submodules)
            if len(submodules) < len(imported) or not imported:
                edges.add(target)
        graph[module] = {target for target in edges if target in names and target != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (its modules, the first repeated at the end) through each set of modules that reach
    one another through imports (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = {stack.pop()}
            while module not in component:
                component.add(stack.pop())
            if len(component) > 1:
                components.append(component)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    cycles = []
    for component in components:  # the shortest way back to the component's first module
        start = min(component)
        paths = {start: [start]}
        frontier = [start]
        while frontier and start not in graph[frontier[0]]:
            module = frontier.pop(0)
            for target in sorted(graph[module] & component):
                if target not in paths:
                    paths[target] = paths[module] + [target]
                    frontier.append(target)
        cycles.append(paths[frontier[0]] + [start])
    return sorted(cycles)


@pytest.mark.parametrize("module, path, is_package", MODULES, ids=lambda v: str(v) if isinstance(v, str) else "")
def test_imports_go_down_and_skip_private_names(module, path, is_package):
    own = _layer(module)
    for target, names in _imports(module, path, is_package):
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        assert not private, f"evolm_lib.{module} imports private {private} from evolm_lib.{target}"
        assert _layer(target) <= own, f"evolm_lib.{module} (layer {own}) imports evolm_lib.{target} (layer {_layer(target)})"
        if module.split(".")[0] != "cli":
            assert target.split(".")[0] != "cli", f"evolm_lib.{module} imports the command line (evolm_lib.{target})"


@pytest.mark.parametrize("module, path, is_package", [m for m in MODULES if m[0].split(".")[0] in PURE],
                         ids=lambda v: str(v) if isinstance(v, str) else "")
def test_pure_folders_import_only_pure_pieces(module, path, is_package):
    for target, _ in _imports(module, path, is_package):
        assert _layer(target) == 0, f"evolm_lib.{module} is pure maths but imports evolm_lib.{target}"


def test_the_checker_sees_every_import_form(tmp_path):
    """`from .. import zo` was once invisible to this test; it must not be again."""
    source = tmp_path / "mod.py"
    source.write_text("from .. import zo, es as e\nfrom evolm_lib import train\nimport evolm_lib.cli.bench\n"
                      "from ..engines.base import X\nfrom . import core\n")
    found = [target for target, _ in _imports("es.mod", source, is_package=False)]
    assert found == ["zo", "es", "train", "cli.bench", "engines.base", "es"]


def test_no_import_cycles():
    """Dependencies go one way, function-level imports included: a cycle that only works because one
    of its imports is deferred still ties its modules into one."""
    cycles = _cycles(_import_graph(MODULES))
    assert not cycles, "import cycles in evolm_lib: " + "; ".join(" -> ".join(cycle) for cycle in cycles)


def test_the_cycle_check_names_a_cycle_of_lazy_imports_and_allows_a_package_its_submodules(tmp_path):
    files = {"pkg": "from .c import h\n", "pkg.a": "def f():\n    from .b import g\n",
             "pkg.b": "from . import a\n", "pkg.c": "from .a import f\nfrom .. import pkg\n", "pkg.d": "from . import c\n"}
    modules = []
    for module, source in files.items():
        path = tmp_path / f"{module}.py"
        path.write_text(source)
        modules.append((module, path, module == "pkg"))
    graph = _import_graph(modules)
    assert graph == {"pkg": {"pkg.c"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg", "pkg.a"}, "pkg.d": {"pkg.c"}}
    assert _cycles(graph) == [["pkg", "pkg.c", "pkg"], ["pkg.a", "pkg.b", "pkg.a"]]
    del graph["pkg.c"]  # a package that imports its submodules, which import one another's names: no cycle
    assert _cycles({**graph, "pkg.c": {"pkg.a"}, "pkg.a": set()}) == []


def test_no_exec_or_eval_in_the_library():
    """Nothing read from a notebook, a spec or a model's output is ever run as code."""
    for module, path, _ in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in {"exec", "eval"}, f"evolm_lib.{module} calls {node.func.id}()"
