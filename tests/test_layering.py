"""The library's layers: no module imports another's private names, and nothing imports upwards."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "evolm_lib"
# bottom to top; a module may import from its own layer or below (the engines import the pure maths,
# the runs import the engines, viz and cli sit on top)
LAYERS = [
    {"seeds", "types", "es.core", "es", "zo", "tasks", "grpo.primitives", "metrics"},
    {"config", "lora", "models", "runs", "env", "paths", "quiet"},
    {"engines", "preflight", "evaluation"},
    {"loop", "es.run", "grpo", "analysis", "batch", "sweep"},
    {"viz", "cli", "benchmark"},
]


def _layer(module: str) -> int:
    parts = module.split(".")
    for depth in (2, 1):
        name = ".".join(parts[:depth])
        for index, layer in enumerate(LAYERS):
            if name in layer:
                return index
    raise AssertionError(f"evolm_lib.{module} is in no layer of tests/test_layering.py: add it")


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).with_suffix("")
        parts = [p for p in relative.parts if p != "__init__"]
        if parts and parts[-1] != "__main__":
            yield ".".join(parts), path, path.name == "__init__.py"


def _imports(module: str, path: Path, is_package: bool):
    """(imported evolm_lib module, names) of every import in a file, lazy ones included."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("evolm_lib"):
                target = node.module.removeprefix("evolm_lib").lstrip(".")
            else:
                continue
            yield target, [alias.name for alias in node.names]


@pytest.mark.parametrize("module, path, is_package", list(_modules()), ids=lambda v: str(v) if isinstance(v, str) else "")
def test_imports_go_down_and_skip_private_names(module, path, is_package):
    own = _layer(module)
    for target, names in _imports(module, path, is_package):
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        assert not private, f"evolm_lib.{module} imports private {private} from evolm_lib.{target}"
        if target:
            assert _layer(target) <= own, f"evolm_lib.{module} (layer {own}) imports evolm_lib.{target} (layer {_layer(target)})"
