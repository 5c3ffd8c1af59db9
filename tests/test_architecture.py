"""The seams hold: no import cycles between llmsession's modules, and the planning modules never
reach the native layer (so hypothesis machines can drive them without a model)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "llmsession"
PURE = (
    "prefix",
    "residency",
    "parking",
    "budget",
    "sessionfile",
    "messages",
    "stops",
    "detokenize",
    "options",
    "splice",
    "checkpoints",
)
NATIVE = {
    "cancel",
    "native",
    "native_context",
    "native_mtmd",
    "sampling",
    "smoke_llama",
}  # the modules that call the bindings


def imports(module: str) -> set[str]:
    """llmsession modules ``module`` imports when it is imported (not inside functions, not for
    type checking only)."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            name = node.module.removeprefix("llmsession.") if node.level == 0 else node.module
            if node.level == 1 or node.module.startswith("llmsession."):
                found.add(name.split(".")[0])
    return found & {p.stem for p in PACKAGE.glob("*.py")}


def test_no_import_cycles() -> None:
    graph = {p.stem: imports(p.stem) for p in PACKAGE.glob("*.py")}
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import cycle: {' -> '.join((*path, module))}"
        if module not in done:
            for child in graph[module]:
                visit(child, (*path, module))
            done.add(module)

    for module in graph:
        visit(module, ())


def test_planning_modules_never_reach_the_native_layer() -> None:
    for module in PURE:
        seen, todo = set(), [module]
        while todo:
            current = todo.pop()
            seen.add(current)
            todo += [m for m in imports(current) if m not in seen]
        native = seen & NATIVE
        assert not native, f"{module} imports the native layer {native} (through {sorted(seen)})"
        assert "llama_cffi" not in (PACKAGE / f"{module}.py").read_text(), module


def test_only_the_native_layer_touches_the_bindings() -> None:
    for path in PACKAGE.glob("*.py"):
        if path.stem not in NATIVE:
            assert "bindings()" not in path.read_text(), f"{path.name} calls the bindings directly"
