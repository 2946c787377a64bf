"""The package's layering (docs/architecture.md), checked on its source: no import cycle, no forbidden import.

Every ``import`` counts, at module level or inside a function: a deferred import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "trl_harbor"

#: Lower layers first; a module may import only modules of its own layer or of layers below.
LAYERS: list[set[str]] = [
    {"runtime", "progress", "options", "tools", "sandboxes", "capture", "trl_compat", "digests", "shared_prefix"},
    {"suite", "suite_lock", "backends"},
    {"sources", "preflight"},
    {"rollout"},
    {"env", "terminus"},
    {"rewards", "harnesses", "agents", "loop", "loop_async"},
    {"mix"},
    {"spec"},
    {"trajectories", "trainer", "freezing"},
    {"prompting"},
    {"check", "evaluate", "option_flags"},
    {"train", "report", "images", "starter_model", "testing"},
    {"cli"},
]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The trl_harbor modules a file imports.

    ``from package import submodule`` is an edge to the submodule only (the package's own ``__init__``
    runs first, but it is not what the importer uses); ``from module import Name`` is an edge to the module.
    """
    found: set[str] = set()
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("trl_harbor")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            if base.startswith("trl_harbor"):
                submodules = {f"{base}.{alias.name}" for alias in node.names} & modules
                found |= submodules
                if len(submodules) < len(node.names):
                    found.add(base)
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        # Only edges to real modules (``from trl_harbor.x import Name`` names a module x, not a module x.Name).
        # ``from trl_harbor import runtime`` names the module; a bare ``trl_harbor`` (its lazy public names)
        # counts as the top of the layering, so that modules import what they use from its own module.
        graph[name] = {t for t in _imports(path, set(files)) if t in files and t != name}
    return graph


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer(module: str) -> int:
    if module == "trl_harbor":
        return len(LAYERS)  # the package's public names: above everything
    top = _top(module)
    for index, layer in enumerate(LAYERS):
        if top in layer:
            return index
    raise AssertionError(f"{module} is in no layer of tests/test_architecture.py: add it there and to the doc")


def test_every_module_has_a_layer() -> None:
    for module in _graph():
        if module != "trl_harbor":
            _layer(module)


def test_no_import_cycle() -> None:
    graph = _graph()
    # Tarjan's strongly connected components: a component of more than one module is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert not cycles, f"import cycles: {cycles}"


def test_imports_flow_down_the_layers() -> None:
    wrong = []
    for module, targets in _graph().items():
        if module == "trl_harbor" or _top(module) == "__main__":
            continue  # the package's lazy re-exports name everything
        for target in targets:
            if target != "trl_harbor" and _layer(target) > _layer(module):
                wrong.append(f"{module} imports {target}")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        ("sandboxes", "anything of trl_harbor outside sandboxes (it is a Harbor plug-in usable without trl-harbor)"),
        ("rollout", "the TRL surface, the specs, the command line or a sandbox backend"),
        ("runtime", "anything of trl_harbor"),
        ("capture", "anything of trl_harbor outside capture (the endpoint serves any trainer and any agent)"),
    ],
)
def test_forbidden_imports(module: str, forbidden: str) -> None:
    allowed = {
        "sandboxes": {"sandboxes"},
        "rollout": {"rollout", "runtime", "progress", "options", "backends"},
        "runtime": {"runtime"},
        "capture": {"capture"},
    }[module]
    offending = [
        f"{source} imports {target}"
        for source, targets in _graph().items()
        if _top(source) == module
        for target in targets
        if _top(target) not in allowed
    ]
    assert not offending, f"{module} must not import {forbidden}:\n" + "\n".join(offending)
