"""The seams hold: llmsession's layers import only downwards, no module takes part in an import
cycle of any kind (top-level, inside a function, or for type checking only), the planning modules
never reach the native layer (so hypothesis machines drive them without a model), only the native
layer calls the bindings, and no module reads another module's private attributes."""

from __future__ import annotations

import ast
import builtins
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "llmsession"
# Lowest first: a module may import its own layer's modules (without cycles) and lower layers'.
LAYERS = (
    (
        "llmsession.errors",
        "llmsession.options",
        "llmsession.config",
        "llmsession.replies",
        "llmsession.buffers",
        "llmsession.files",
    ),
    ("llmsession.text",),
    ("llmsession.native",),
    ("llmsession.engine",),
    ("llmsession.runtime",),
    ("llmsession.remote",),
    ("llmsession.api", "llmsession"),
    ("llmsession.serve",),
    ("llmsession.cluster",),
    ("llmsession.commands", "llmsession.__main__"),
)
PURE = (  # decisions without effects: no path to the native layer
    "llmsession.engine.prefix",
    "llmsession.engine.residency",
    "llmsession.engine.parking",
    "llmsession.engine.budget",
    "llmsession.engine.chunking",
    "llmsession.engine.attention",
    "llmsession.engine.drafting",
    "llmsession.engine.sessionfile",
    "llmsession.engine.sessionread",
    "llmsession.engine.checkpoints",
    "llmsession.runtime.keeping",
    "llmsession.options",
    "llmsession.config",
    "llmsession.text.messages",
    "llmsession.text.stops",
    "llmsession.text.reasoning",
    "llmsession.text.logprobs",
    "llmsession.text.detokenize",
    "llmsession.text.splice",
    "llmsession.text.segments",
    "llmsession.text.schemas",
    "llmsession.text.templates",
    "llmsession.text.gemma4_tools",
    "llmsession.text.gemma4_calls",
    "llmsession.text.tool_formats",
    "llmsession.text.tool_grammar",
    "llmsession.serve.schema",
    "llmsession.serve.naming",
    "llmsession.serve.messages",
    "llmsession.serve.messages_sse",
    "llmsession.serve.responses",
    "llmsession.serve.responses_sse",
    "llmsession.serve.store",
    "llmsession.serve.body",
    "llmsession.serve.sse",
    "llmsession.serve.errors",
    "llmsession.serve.metrics",
    "llmsession.cluster.keys",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


@cache
def tree(module: str) -> ast.Module:
    return ast.parse(MODULES[module].read_text())


@cache
def imports(module: str) -> frozenset[str]:
    """Every llmsession module ``module`` imports: at the top, inside functions, and under
    ``TYPE_CHECKING`` alike (``from package import module`` counts as the module)."""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree(module)):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in MODULES else base)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return frozenset(found & set(MODULES) - {module})


def layer(module: str) -> int:
    """The index in ``LAYERS`` of the longest prefix naming ``module``'s layer."""
    best, rank = -1, -1
    for index, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, rank = len(name), index
    assert rank >= 0, f"{module} belongs to no layer: add it to LAYERS"
    return rank


def test_every_module_belongs_to_a_layer_and_imports_only_downwards() -> None:
    wrong = [
        f"{module} (layer {layer(module)}) imports {other} (layer {layer(other)})"
        for module in MODULES
        for other in imports(module)
        if layer(other) > layer(module)
    ]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles_of_any_kind() -> None:
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import cycle: {' -> '.join((*path, module))}"
        if module not in done:
            for child in sorted(imports(module)):
                if child != module.rpartition(".")[0]:  # a package's __init__ runs first anyway
                    visit(child, (*path, module))
            done.add(module)

    for module in sorted(MODULES):
        visit(module, ())


def test_the_check_sees_function_level_and_type_checking_imports() -> None:
    """A variant that must fail: the walk finds imports the old top-level-only check missed."""
    assert "llmsession.engine.engine" in imports("llmsession.engine.seat") or any(
        "TYPE_CHECKING" in ast.unparse(node) for node in ast.walk(tree("llmsession.engine.seat"))
    )
    lazy = {m for m in imports("llmsession") if m.startswith("llmsession.runtime")}
    assert lazy, "llmsession/__init__.py names its lazy modules under TYPE_CHECKING"


def test_planning_modules_never_reach_the_native_layer() -> None:
    for module in PURE:
        seen, todo = set(), [module]
        while todo:
            current = todo.pop()
            seen.add(current)
            todo += [m for m in imports(current) if m not in seen]
        native = {m for m in seen if m.startswith("llmsession.native")}
        assert not native, f"{module} reaches the native layer {native}"
        assert "llama_cffi" not in MODULES[module].read_text(), module


def test_only_the_native_layer_calls_the_bindings() -> None:
    for module, path in MODULES.items():
        if not module.startswith("llmsession.native"):
            assert "bindings()" not in path.read_text(), f"{module} calls the bindings directly"


def own_private_names(module: str) -> set[str]:
    """The private names ``module`` defines: its functions, classes and their methods, and the
    attributes its code assigns (``self._x = ...``, ``other._x = ...``)."""
    names: set[str] = set()
    for node in ast.walk(tree(module)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return {name for name in names if name.startswith("_")}


def private_reads(module: str) -> list[str]:
    """``thing._name`` where ``_name`` is not one of ``module``'s own private names and
    ``thing`` is not an imported module of the standard library or a dependency."""
    own = own_private_names(module)
    outside = {
        alias.asname or alias.name
        for node in ast.walk(tree(module))
        if isinstance(node, ast.Import | ast.ImportFrom)
        and not (
            isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("llmsession"))
        )
        for alias in node.names
    }
    found = []
    for node in ast.walk(tree(module)):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and node.attr not in own
            and not (
                isinstance(node.value, ast.Name)
                and (node.value.id in outside or hasattr(builtins, node.value.id))
            )
        ):
            found.append(f"{module}:{node.lineno} reads {ast.unparse(node)}")
    return found


def test_no_module_reads_another_modules_private_attributes() -> None:
    found = [read for module in MODULES for read in private_reads(module)]
    assert not found, "\n".join(found)


def test_the_private_read_check_catches_one() -> None:
    """A variant that must fail: a read of another module's private attribute is found."""
    source = "def f(model):\n    return model._engine\n"
    module = "llmsession.errors"
    tree.cache_clear()
    try:
        MODULES[module].read_text()  # (exists)
        original = tree(module)
        assert not private_reads(module)
        tree.cache_clear()
        import unittest.mock

        with unittest.mock.patch(f"{__name__}.tree", return_value=ast.parse(source)):
            assert private_reads(module) == [f"{module}:2 reads model._engine"]
        assert ast.dump(tree(module)) == ast.dump(original)
    finally:
        tree.cache_clear()


def test_no_module_over_400_lines_nor_function_over_60() -> None:
    long_modules = [
        f"{m} has {n} lines" for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 400
    ]
    long_functions = [
        f"{m}.{node.name} has {node.end_lineno - node.lineno + 1} lines"
        for m in MODULES
        for node in ast.walk(tree(m))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > 60
    ]
    assert not long_modules + long_functions, "\n".join(long_modules + long_functions)


def test_every_subpackage_ships_in_the_wheel() -> None:
    """pyproject.toml lists the packages by name: a new layer left out would import here and
    fail once installed."""
    import tomllib

    listed = set(
        tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    packages = {module_name(path) for path in PACKAGE.rglob("__init__.py")}
    assert packages <= listed, f"missing from pyproject.toml: {sorted(packages - listed)}"


# -- the public surface ----------------------------------------------------------------------------
README = (PACKAGE.parent / "README.md").read_text()
TOP_CLASSES = ("Model", "Session", "Stream", "AsyncStream", "Choices", "Transcript")
INHERITED = {"index", "count"}  # ``Sequence``'s mixins on ``Choices``


def public_surface() -> dict[str, object]:
    """Everything ``llmsession`` exports, and ``llmsession.serve.create_app``."""
    import llmsession
    import llmsession.serve

    surface = {name: getattr(llmsession, name) for name in llmsession.__all__}
    surface["create_app"] = llmsession.serve.create_app
    return surface


def callables_of(name: str, value: object) -> list[tuple[str, object]]:
    """A public function, or a public class's constructor and public methods."""
    import inspect

    if not isinstance(value, type):
        return [(name, value)] if inspect.isfunction(value) else []  # (not a type alias)
    found = [(f"{name}.__init__", value.__init__)] if "__init__" in vars(value) else []
    for attr, member in vars(value).items():
        if not attr.startswith("_") and callable(member):
            found.append((f"{name}.{attr}", member))
    return found


def loose_keywords(name: str, function: object) -> list[str]:
    """``**kwargs`` whose type a checker cannot see (unannotated, ``Any`` or ``object``)."""
    import inspect
    import re

    try:
        signature = inspect.signature(function)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return []
    return [
        f"{name}(**{p.name}: {p.annotation if p.annotation is not p.empty else 'unannotated'})"
        for p in signature.parameters.values()
        if p.kind is p.VAR_KEYWORD
        and (p.annotation is p.empty or re.search(r"\b(Any|object)\b", str(p.annotation)))
    ]


def test_no_public_signature_takes_untyped_keywords() -> None:
    """Settings are typed (``Unpack[ModelSettings]``): a misspelled one is a type error."""
    problems = [
        problem
        for name, value in public_surface().items()
        for qualified, function in callables_of(name, value)
        for problem in loose_keywords(qualified, function)
    ]
    assert problems == []


def test_the_untyped_keywords_check_catches_one() -> None:
    from typing import Any

    def settings_as_before(path: str, **settings: Any) -> None: ...

    def typed(path: str, **overrides: int) -> None: ...

    def anything(path: str, **overrides: object) -> None: ...

    assert loose_keywords("Model", settings_as_before) and loose_keywords("Model", anything)
    assert not loose_keywords("Model", typed)


def llmsession_classes() -> dict[str, str]:
    """Every class and type alias defined at the top of an llmsession module, by name."""
    found: dict[str, str] = {}
    for module in MODULES:
        for node in tree(module).body:
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, module)
            elif isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = node.targets[0]
                if isinstance(target, ast.Name) and target.id[:1].isupper() and not target.id.isupper():
                    found.setdefault(target.id, module)
    return found


def exposed_annotations(value: type) -> list[tuple[str, str]]:
    """The annotations of a class's public fields, properties and methods' return values."""
    import re

    found = []
    for klass in reversed(value.__mro__):
        if klass.__module__.startswith("llmsession"):
            for field, annotation in vars(klass).get("__annotations__", {}).items():
                if not field.startswith("_"):  # (a ``Setting[T]`` descriptor reads as a T)
                    found.append(
                        (f"{value.__name__}.{field}", re.sub(r"^Setting\[(.*)\]$", r"\1", str(annotation)))
                    )
            for attr, member in vars(klass).items():
                if attr.startswith("_"):
                    continue
                function = member.fget if isinstance(member, property) else member
                returned = getattr(function, "__annotations__", {}).get("return")
                if returned is not None:
                    found.append((f"{value.__name__}.{attr}", str(returned)))
    return found


def unexported_types(exported: set[str], annotations: list[tuple[str, str]]) -> list[str]:
    import re

    ours = llmsession_classes()
    return [
        f"{where}: {name} ({ours[name]}) is not exported"
        for where, annotation in annotations
        for name in re.findall(r"[A-Za-z_]\w*", annotation)
        if name in ours and name not in exported
    ]


def test_every_public_field_and_return_type_is_exported() -> None:
    """What a public field holds or a public call returns can be named by its user: imported
    from ``llmsession``, where a type checker and the documentation find it."""
    surface = public_surface()
    annotations = [
        pair for value in surface.values() if isinstance(value, type) for pair in exposed_annotations(value)
    ]
    assert len(annotations) > 100
    assert unexported_types(set(surface), annotations) == []


def test_the_exported_types_check_catches_one() -> None:
    """A variant that must fail: a reply field typed by a class ``llmsession`` does not export."""
    from dataclasses import dataclass

    import llmsession

    @dataclass
    class Leaky:
        calls: tuple[ToolCall, ...]  # noqa: F821
        tools: Tools | None  # noqa: F821  # (llmsession.text.tools: not exported)

    Leaky.__module__ = "llmsession.leaky"
    problems = unexported_types(set(llmsession.__all__), exposed_annotations(Leaky))
    assert problems == ["Leaky.tools: Tools (llmsession.text.tools) is not exported"]


def instance_attributes(value: type) -> set[str]:
    """The public attributes a class's ``__init__`` assigns (``self.path = ...``)."""
    import inspect
    import textwrap

    init = vars(value).get("__init__")
    if init is None:
        return set()
    body = ast.parse(textwrap.dedent(inspect.getsource(init)))
    return {
        target.attr
        for node in ast.walk(body)
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        for target in (target.elts if isinstance(target, ast.Tuple) else [target])
        if isinstance(target, ast.Attribute) and not target.attr.startswith("_")
    }


def public_names(value: type) -> set[str]:
    names = set(instance_attributes(value))
    for klass in value.__mro__:
        if klass.__module__.startswith("llmsession"):
            names |= {n for n in vars(klass) if not n.startswith("_")}
            names |= {n for n in vars(klass).get("__annotations__", {}) if not n.startswith("_")}
    return names - INHERITED


def undocumented(value: type, readme: str) -> list[str]:
    """The public names of ``value`` the README does not name in code (`` `name` ``,
    `` `name(...)` ``, `` `obj.name` ``)."""
    import re

    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", readme, flags=re.S | re.M)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", readme, flags=re.S | re.M)
    spans = " ".join([*fenced, *re.findall(r"`([^`]+)`", prose)])
    return sorted(n for n in public_names(value) if not re.search(rf"(?<![\w]){re.escape(n)}(?![\w])", spans))


def test_the_top_classes_have_no_public_name_the_readme_does_not_document() -> None:
    surface = public_surface()
    problems = {name: undocumented(surface[name], README) for name in TOP_CLASSES}  # type: ignore[arg-type]
    assert all(len(public_names(surface[name])) >= 3 for name in TOP_CLASSES)  # type: ignore[arg-type]
    assert {name: names for name, names in problems.items() if names} == {}


def test_the_readme_check_catches_an_undocumented_name() -> None:
    class Model:
        def session(self) -> None: ...

        def lease(self) -> None: ...  # plumbing made public

    Model.__module__ = "llmsession.api.model"
    assert undocumented(Model, "`model.session()` makes one") == ["lease"]


BELOW_THE_API = ("llmsession.runtime", "llmsession.engine", "llmsession.native", "llmsession.remote")


def reaches_under(module: str) -> list[str]:
    """What a server module imports from below the public API."""
    return sorted(m for m in imports(module) if m.startswith(BELOW_THE_API))


def test_the_server_stands_on_the_public_api() -> None:
    """``serve/`` is routes and translation: every call it makes is one a library user can."""
    server = [m for m in MODULES if m.startswith("llmsession.serve")]
    assert len(server) >= 8
    assert {m: found for m in server if (found := reaches_under(m))} == {}


def test_the_server_check_catches_a_reach_under() -> None:
    """The variant that must fail: the server's ``n`` as it was, on ``stateless.split``."""
    import unittest.mock

    source = "from llmsession.runtime.stateless import split\nfrom llmsession import Model\n"
    tree.cache_clear()
    imports.cache_clear()
    try:
        with unittest.mock.patch(f"{__name__}.tree", return_value=ast.parse(source)):
            assert reaches_under("llmsession.serve.chat") == ["llmsession.runtime.stateless"]
    finally:
        tree.cache_clear()
        imports.cache_clear()
