"""Reads trainguard's own imports (ast only, nothing is executed) and measures its structure.

Used by ``tests/unit/test_structure.py`` (which fails on what this finds) and runnable as a script
for the numbers: ``python tests/structure.py``.

Every import counts: module level, inside functions, under ``TYPE_CHECKING``, and
``importlib.import_module("trainguard...")`` with a literal name or an f-string that starts with
one (a lazy import is still an import). ``plugins/`` and ``fixtures/`` are read as ``trainguard.plugins`` and
``trainguard.fixtures``, the packages they are installed as.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# installed package -> source folder (pyproject.toml's package-dir)
SOURCES = {
    "trainguard": ROOT / "trainguard",
    "trainguard.plugins": ROOT / "plugins",
    "trainguard.fixtures": ROOT / "fixtures",
}


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    tree: ast.Module
    lines: int
    # (imported module, imported name or None, line)
    imports: list[tuple[str, str | None, int]] = field(default_factory=list)
    # (module alias target, private attribute, line): `mod._name` on an imported module
    private_attrs: list[tuple[str, str, int]] = field(default_factory=list)


def _module_name(package: str, folder: Path, path: Path) -> tuple[str, bool]:
    rel = path.relative_to(folder).with_suffix("")
    parts = list(rel.parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join([package, *parts]), is_package


#: the layers, lowest first (docs/architecture.md): a module may import its own layer and lower
#: ones, never a higher one. A package prefix names every module under it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("trainguard._internal", "trainguard.errors", "trainguard.report", "trainguard.evidence",
                    "trainguard._version")),
    ("launch", ("trainguard.launch",)),
    ("unit", ("trainguard.unit",)),
    ("raytrain", ("trainguard.raytrain",)),
    ("config", ("trainguard.config",)),
    ("run", ("trainguard.run",)),
    ("tracking", ("trainguard.tracking",)),
    ("checks", ("trainguard.checks",)),
    ("faults", ("trainguard.faults",)),
    ("drills", ("trainguard.drills",)),
    ("profiling", ("trainguard.profiling",)),
    ("session", ("trainguard.session",)),
    ("queue", ("trainguard.queue",)),
    ("ray jobs", ("trainguard.raytrain.ray_jobs",)),
    ("gate", ("trainguard.gate",)),
    ("cli", ("trainguard.cli",)),
    ("pytest", ("trainguard.plugins", "trainguard.fixtures")),
]

#: the curated public API (``trainguard/__init__.py``): it names every layer (lazily), so it
#: stands above them all. No other module re-exports or forwards (docs/architecture.md, "One path
#: per name"): :func:`reexport_shims`, :func:`reexported_names` and :func:`forwards` find them.
PUBLIC_API = "trainguard"

#: runs inside the user's training process on the standard library alone (start-up hook)
STDLIB_ONLY = frozenset({
    "trainguard.launch.hook._trainguard_fault_agent",
    "trainguard.launch.hook._trainguard_nan_agent",
    "trainguard.launch.hook._trainguard_run_agent",
    "trainguard.launch.hook._trainguard_step_agent",
    "trainguard.launch.hook._trainguard_step_values",
    "trainguard.launch.hook.sitecustomize",
})


#: a backend's own package: no module outside it imports it, but for these (importer, imported)
#: pairs -- the job kind's registration line (docs/architecture.md, "Ray's code in raytrain/ only")
OWN_PACKAGES: dict[str, frozenset[tuple[str, str]]] = {
    "trainguard.raytrain": frozenset({("trainguard.config.backends", "trainguard.raytrain.backend")}),
}


def foreign_imports(modules: dict[str, Module], owned: dict[str, frozenset[tuple[str, str]]] | None = None) -> list[str]:
    """Imports of a package of :data:`OWN_PACKAGES` (or ``owned``) from a module outside it,
    its allowed pairs excepted; function-level, ``TYPE_CHECKING`` and literal ``import_module``
    imports count."""
    owned = OWN_PACKAGES if owned is None else owned
    found = []
    for module in modules.values():
        for package, allowed in owned.items():
            if module.name == package or module.name.startswith(package + "."):
                continue
            for imported, _name, line in module.imports:
                target = _target(modules, imported) or imported
                if (target == package or target.startswith(package + ".")) and (module.name, target) not in allowed:
                    found.append(f"{_rel(module.path)}:{line}: {module.name} imports {target}")
    return sorted(set(found))


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of ``module`` (None for an unplaced module)."""
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for index, (_name, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (
                best is None or len(prefix) > best[0]
            ):
                best = (len(prefix), index)
    return None if best is None else best[1]


def upward_imports(modules: dict[str, Module]) -> list[str]:
    """Imports of a higher layer (the curated API excepted)."""
    found = []
    for module in modules.values():
        if module.name == PUBLIC_API:
            continue
        own = layer_of(module.name)
        for imported, _name, line in module.imports:
            target = _target(modules, imported)
            if target is None or target == module.name:
                continue
            theirs = layer_of(target)
            if own is not None and theirs is not None and theirs > own:
                found.append(f"{_rel(module.path)}:{line}: {module.name} "
                             f"({LAYERS[own][0]}) imports {target} ({LAYERS[theirs][0]})")
    return found


def _all_names(module: Module) -> list[str]:
    for node in module.tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]:
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return []
            return [str(v) for v in value]
    return []


def _imported_names(module: Module) -> dict[str, str]:
    """Name bound at module level by ``from trainguard... import name`` -> the module it names."""
    bound: dict[str, str] = {}
    for node in module.tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trainguard"):
            for alias in node.names:
                bound[alias.asname or alias.name] = node.module or ""
    return bound


def reexport_shims(modules: dict[str, Module]) -> list[str]:
    """Modules (not packages, not the curated API) whose body is only a docstring, imports of
    trainguard and ``__all__``: an old path kept alive, a second home for names."""
    found = []
    for module in modules.values():
        if module.is_package or module.name == PUBLIC_API:
            continue
        body = [n for n in module.tree.body
                if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        imports = [n for n in body if isinstance(n, ast.ImportFrom | ast.Import)]
        rest = [n for n in body if n not in imports and not (
            isinstance(n, ast.Assign) and [getattr(t, "id", None) for t in n.targets] == ["__all__"])]
        if imports and not rest and all(
            isinstance(n, ast.ImportFrom) and (n.module or "").startswith(("trainguard", "__future__"))
            for n in imports
        ):
            found.append(f"{_rel(module.path)}: {module.name} only re-exports")
    return found


def reexported_names(modules: dict[str, Module]) -> list[str]:
    """Names a module (not a package's ``__init__``, not the curated API) lists in ``__all__``
    but imports from another trainguard module: a second public home for one name."""
    found = []
    for module in modules.values():
        if module.is_package or module.name == PUBLIC_API:
            continue
        bound = _imported_names(module)
        for name in _all_names(module):
            if name in bound:
                found.append(f"{_rel(module.path)}: {module.name} re-exports {name} from {bound[name]}")
    return found


def forwards(modules: dict[str, Module]) -> list[str]:
    """Module-level ``__getattr__`` that imports trainguard (a forward to another home), outside
    the curated API."""
    found = []
    for module in modules.values():
        if module.name == PUBLIC_API:
            continue
        for node in module.tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                lines = range(node.lineno, (node.end_lineno or node.lineno) + 1)
                if any(line in lines for _imported, _name, line in module.imports):
                    found.append(f"{_rel(module.path)}:{node.lineno}: {module.name}.__getattr__ forwards")
    return found


def unplaced(modules: dict[str, Module]) -> list[str]:
    """Modules in no layer (the curated API excepted)."""
    return sorted(n for n in modules if n != PUBLIC_API and layer_of(n) is None)


def load_modules(sources: dict[str, Path] | None = None) -> dict[str, Module]:
    """Every module of the installed package (or of ``sources``: package -> folder), parsed."""
    sources = SOURCES if sources is None else sources
    modules: dict[str, Module] = {}
    for package, folder in sources.items():
        for path in sorted(folder.rglob("*.py")):
            if any(
                path.is_relative_to(other)
                for other in sources.values()
                if other != folder and other.is_relative_to(folder)
            ):
                continue
            name, is_package = _module_name(package, folder, path)
            text = path.read_text(encoding="utf-8")
            modules[name] = Module(
                name, path, is_package, ast.parse(text, str(path)), len(text.splitlines())
            )
    for module in modules.values():
        _read_imports(module, modules)
    return modules


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _resolve_relative(module: Module, level: int, target: str | None) -> str:
    base = module.name.split(".")
    if not module.is_package:
        base = base[:-1]
    if level > 1:
        base = base[: -(level - 1)]
    return ".".join([*base, target] if target else base)


def _read_imports(module: Module, modules: dict[str, Module]) -> None:
    aliases: dict[str, str] = {}  # local name -> trainguard module it stands for
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "trainguard":
                    module.imports.append((alias.name, None, node.lineno))
                    if alias.asname:
                        aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            source = (
                _resolve_relative(module, node.level, node.module) if node.level else node.module
            )
            if not source or source.split(".")[0] != "trainguard":
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in modules:  # `from pkg import submodule`
                    module.imports.append((submodule, None, node.lineno))
                    aliases[alias.asname or alias.name] = submodule
                else:
                    module.imports.append((source, alias.name, node.lineno))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            == "import_module"
            and node.args
        ):
            for name in _imported_by_name(module, node.args[0], modules):
                module.imports.append((name, None, node.lineno))
    for node in ast.walk(module.tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            module.private_attrs.append((aliases[node.value.id], node.attr, node.lineno))


def _imported_by_name(module: Module, name: ast.expr, modules: dict[str, Module]) -> list[str]:
    """The trainguard modules ``import_module(name)`` may import: a literal names one; an
    f-string whose text starts with ``trainguard.`` (``f"trainguard.profiling.{part}"``) names
    each module its prefix makes with a string of the same module (the table it looks ``part``
    up in), else the package its prefix names."""
    if isinstance(name, ast.Constant) and isinstance(name.value, str):
        return [name.value] if name.value.startswith("trainguard") else []
    if not (isinstance(name, ast.JoinedStr) and name.values and isinstance(name.values[0], ast.Constant)):
        return []
    prefix = str(name.values[0].value)
    if not prefix.startswith("trainguard"):
        return []
    strings = {n.value for n in ast.walk(module.tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    named = sorted(prefix + s for s in strings if prefix + s in modules)
    return named or [prefix.rstrip(".")]


def _target(modules: dict[str, Module], imported: str) -> str | None:
    """The trainguard module an import names (a missing one: its nearest existing parent)."""
    name = imported
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def edges(modules: dict[str, Module]) -> dict[str, set[str]]:
    """module -> the trainguard modules it imports (itself excluded)."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for module in modules.values():
        for imported, _name, _line in module.imports:
            target = _target(modules, imported)
            if target and target != module.name:
                graph[module.name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(start: str) -> None:  # iterative, so a deep graph cannot hit the recursion limit
        nonlocal counter
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_module_part(module: str) -> str | None:
    """The first private segment of a dotted module name, `_internal` excepted."""
    for part in module.split(".")[1:]:
        if _is_private(part) and part != "_internal":
            return part
    return None


def _owner(module: str) -> str:
    """The package a private module belongs to (the part before its private segment)."""
    parts = module.split(".")
    for i, part in enumerate(parts[1:], start=1):
        if _is_private(part) and part != "_internal":
            return ".".join(parts[:i])
    return module


def private_imports(modules: dict[str, Module]) -> list[str]:
    """Private names taken from another module: `from a import _x`, `a._x`, `import a._mod`.

    Public names of the `_internal` package are fine; so is a private module used by its own
    package (``trainguard.launch.hook`` running its ``_trainguard_fault_agent``).
    """
    found = []
    for module in modules.values():
        for imported, name, line in module.imports:
            where = f"{_rel(module.path)}:{line}"
            if name is not None and _is_private(name):
                found.append(f"{where}: {name} from {imported}")
            private_part = _private_module_part(imported)
            if private_part and not module.name.startswith(_owner(imported)):
                found.append(f"{where}: private module {imported}")
        for imported, attr, line in module.private_attrs:
            found.append(f"{_rel(module.path)}:{line}: {imported}.{attr}")
    return found


def long_files(modules: dict[str, Module], limit: int) -> list[tuple[str, int]]:
    return sorted(
        ((_rel(m.path), m.lines) for m in modules.values() if m.lines > limit),
        key=lambda item: -item[1],
    )


#: the code whose job is to turn records into JSON and back (or to speak a JSON API): a
#: ``dict[str, Any]`` there is the wire format itself, not a record left untyped
SERIALISATION = (
    "trainguard.evidence", "trainguard.report", "trainguard.config.records", "trainguard._internal.readers",
    "trainguard.launch.hook", "trainguard.faults.toxiproxy.client", "trainguard.tracking",
)
#: methods that are serialisation wherever they are
SERIALISERS = frozenset({"to_dict", "from_dict", "to_json", "from_json"})
_ANY = frozenset({"Any", "object"})


def _string_map(node: ast.expr, aliases: frozenset[str]) -> bool:
    """``dict``/``Mapping``/``MutableMapping`` of ``str`` to ``Any`` or ``object``, or a name
    that aliases one."""
    if isinstance(node, (ast.Name, ast.Attribute)):
        return (node.id if isinstance(node, ast.Name) else node.attr) in aliases
    if not isinstance(node, ast.Subscript) or not isinstance(node.slice, ast.Tuple):
        return False
    base = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", "")
    key, value = [*node.slice.elts, None, None][:2]
    return (base in ("dict", "Dict", "Mapping", "MutableMapping") and isinstance(key, ast.Name)
            and key.id == "str" and isinstance(value, (ast.Name, ast.Attribute))
            and (value.id if isinstance(value, ast.Name) else value.attr) in _ANY)


def _annotations(tree: ast.AST) -> Iterator[tuple[ast.expr, int, str | None]]:
    """Every expression inside every annotation (so ``list[dict[str, Any]] | None`` is seen),
    with the annotation's line and the function it belongs to."""
    def visit(node: ast.AST, function: str | None) -> Iterator[tuple[ast.expr, int, str | None]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = child.args
                for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                    if arg is not None and arg.annotation is not None:
                        yield arg.annotation, arg.lineno, child.name
                if child.returns is not None:
                    yield child.returns, child.lineno, child.name
                yield from visit(child, child.name)
            elif isinstance(child, ast.AnnAssign):
                yield child.annotation, child.lineno, function
            else:
                yield from visit(child, function)
    for annotation, line, function in visit(tree, None):
        for node in ast.walk(annotation):
            if isinstance(node, ast.expr):
                yield node, line, function


def string_map_aliases(modules: dict[str, Module]) -> frozenset[str]:
    """Module-level names bound to an untyped string map (``Params = dict[str, Any]``)."""
    names: set[str] = set()
    for module in modules.values():
        for node in module.tree.body:
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, ast.AnnAssign) else [])
            if value is not None and _string_map(value, frozenset()):
                names.update(t.id for t in targets if isinstance(t, ast.Name))
    return frozenset(names)


def untyped_string_maps(modules: dict[str, Module]) -> list[str]:
    """Every annotation that is an untyped string map (aliases included), outside the
    serialisation code: ``file:line`` each, once per line."""
    aliases = string_map_aliases(modules)
    found: set[str] = set()
    for name, module in modules.items():
        if not name.startswith("trainguard.") or name.startswith(("trainguard.plugins", "trainguard.fixtures")):
            continue
        if name.startswith(SERIALISATION):
            continue
        for node, line, function in _annotations(module.tree):
            if function not in SERIALISERS and _string_map(node, aliases):
                found.add(f"{_rel(module.path)}:{line}")
    return sorted(found, key=lambda s: (s.rsplit(":", 1)[0], int(s.rsplit(":", 1)[1])))


#: what a check reaches around its context through: the runner that launches and its scheduler
#: (a check names its runs to its context, ``trainguard.checks.context``, which alone asks them)
POOL_INSIDES = frozenset({"runner", "scheduling", "_host"})
#: the one module that asks the pool's scheduler for a check
CONTEXT_MODULE = "trainguard.checks.context"


def context_bypasses(modules: dict[str, Module], check_modules: frozenset[str]) -> list[str]:
    """``<x>.pool.runner``, ``<x>.pool.scheduling`` (and the pool's ``_host``) read in a module
    of ``trainguard.checks`` or in one of ``check_modules`` (the registry's check modules),
    :data:`CONTEXT_MODULE` aside: ``file:line: <x>.pool.<attribute>`` each."""
    found = []
    for name, module in modules.items():
        if name == CONTEXT_MODULE or not (name.startswith("trainguard.checks.") or name in check_modules):
            continue
        for node in ast.walk(module.tree):
            if (isinstance(node, ast.Attribute) and node.attr in POOL_INSIDES
                    and isinstance(node.value, ast.Attribute) and node.value.attr == "pool"):
                found.append(f"{_rel(module.path)}:{node.lineno}: {ast.unparse(node)}")
    return sorted(found)


def main() -> None:
    modules = load_modules()
    graph = edges(modules)
    found_cycles = cycles(graph)
    private = private_imports(modules)
    library = {n: m for n, m in modules.items() if not n.startswith(("trainguard.plugins",
                                                                    "trainguard.fixtures"))}
    print(f"modules: {len(modules)}, import edges: {sum(len(v) for v in graph.values())}")
    print(f"import cycles (strongly connected components): {len(found_cycles)}")
    for component in found_cycles:
        print("  ", " <-> ".join(component))
    print(f"private names imported across modules: {len(private)}")
    for line in private:
        print("  ", line)
    upward = upward_imports(modules)
    print(f"imports of a higher layer: {len(upward)}")
    for line in upward:
        print("  ", line)
    foreign = foreign_imports(modules)
    print(f"imports of a backend's own package from outside it: {len(foreign)}")
    for line in foreign:
        print("  ", line)
    print(f"modules in no layer: {unplaced(modules)}")
    for what, found in (("re-export shims", reexport_shims(modules)),
                        ("names re-exported by a module", reexported_names(modules)),
                        ("module-level forwards", forwards(modules))):
        print(f"{what}: {len(found)}")
        for line in found:
            print("  ", line)
    untyped = untyped_string_maps(modules)
    print(f"untyped string maps (dict/Mapping of str to Any or object) outside the serialisation code: {len(untyped)}")
    for limit in (600, 700):
        over = long_files(library, limit)
        print(f"library files over {limit} lines: {len(over)}")
        if limit == 600:
            for path, lines in over:
                print(f"   {lines:5d} {path}")


if __name__ == "__main__":
    sys.exit(main())
