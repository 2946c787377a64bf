"""The package's layout and layering (docs/architecture.md), checked on its source.

Four folders show the architecture: ``rollout/`` (the rollout core: no trainer, no command line),
``training/`` (the TRL surface), ``loop/`` (loop-owning agents) and ``cli/`` (the command line), beside
the foundations every folder uses (``runtime``, ``progress``, ``options``). The checks: no import cycle,
imports flowing down the layers, each folder's forbidden imports, and the local sandbox's package
(``harbor_local_sandbox``) named by its backend alias alone.

Every ``import`` counts, at module level or inside a function: a deferred import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "trl_harbor"

#: What the package's top level holds: the foundations, the four folders and the public helpers.
TOP_LEVEL = {
    "__init__.py", "runtime.py", "progress.py", "options.py", "testing.py", "py.typed",
    "rollout", "training", "loop", "cli",
}  # fmt: skip

#: Lower layers first; a module may import only modules of its own layer or of layers below. A module's
#: layer is its longest key here (``rollout.suite`` before ``rollout``).
LAYERS: list[set[str]] = [
    {"runtime", "progress", "options", "rollout.digests", "rollout.contract", "loop.capture",
     "training.trl_compat", "training.shared_prefix", "training.tools", "training", "loop"},
    {"rollout.suite", "rollout.suite_lock", "rollout.backends"},
    {"rollout.sources", "rollout.preflight"},
    {"rollout"},
    {"training.env", "loop.terminus"},
    {"training.rewards", "training.harnesses", "training.agents", "loop.rollout_func", "loop.async_worker"},
    {"training.mix"},
    {"training.spec"},
    {"cli.trajectories", "training.trainer", "training.freezing"},
    {"cli.prompting"},
    {"cli.check", "cli.evaluate", "cli.option_flags"},
    {"cli.train", "cli.report", "cli.images", "cli.starter_model", "testing"},
    {"cli"},
]  # fmt: skip


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


def _within(module: str, key: str) -> bool:
    """Whether ``module`` (``trl_harbor.x.y``) is ``key`` (``x.y``, ``x``) or inside it."""
    name = module.removeprefix("trl_harbor.")
    return name == key or name.startswith(key + ".")


def _layer(module: str) -> int:
    if module == "trl_harbor":
        return len(LAYERS)  # the package's public names: above everything
    found = [(len(key), index) for index, layer in enumerate(LAYERS) for key in layer if _within(module, key)]
    if not found:
        raise AssertionError(f"{module} is in no layer of tests/test_architecture.py: add it there and to the doc")
    return max(found)[1]


def test_the_top_level_holds_the_foundations_and_the_four_folders() -> None:
    found = {p.name for p in PACKAGE.iterdir() if p.name != "__pycache__"}
    assert found == TOP_LEVEL, (
        "a new top-level module: put it in the folder of its concept (rollout, training, loop, cli), "
        "or add it to TOP_LEVEL and docs/architecture.md with why"
    )


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


#: Each folder's (or module's) allowed imports of trl_harbor; everything else is forbidden.
ALLOWED = {
    "rollout": ({"rollout", "runtime", "progress", "options"}, "the TRL surface, the loop-owning agents, the command line"),
    "runtime": (set(), "anything of trl_harbor"),
    "loop.capture": ({"loop.capture"}, "anything of trl_harbor outside it (the endpoint serves any trainer and any agent)"),
    "training": ({"training", "rollout", "loop", "runtime", "progress", "options", "trl_harbor"}, "the command line"),
    "loop": ({"loop", "training", "rollout", "runtime", "progress", "options", "trl_harbor"}, "the command line"),
}  # fmt: skip


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_forbidden_imports(folder: str) -> None:
    allowed, forbidden = ALLOWED[folder]
    offending = [
        f"{source} imports {target}"
        for source, targets in _graph().items()
        if _within(source, folder)
        for target in targets
        if not any(_within(target, key) or target == key for key in allowed)
    ]
    assert not offending, f"{folder} must not import {forbidden}:\n" + "\n".join(offending)


def test_only_the_backend_alias_names_the_local_sandbox_package() -> None:
    """The integration reaches the local sandbox through Harbor's factory, by the alias of
    ``rollout/backends.py``: no other module imports ``harbor_local_sandbox`` or names it (``images`` gets the
    package's image command from there too), so ``env``, ``train`` and the rest hold no special case."""
    offending = []
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative == "rollout/backends.py":
            continue
        tree = ast.parse(path.read_text())
        docstrings = {  # prose may name the package; code may not
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                names = ["harbor_local_sandbox (in a string)"] if "harbor_local_sandbox" in node.value else []
            offending += [f"{relative}:{node.lineno}: {n}" for n in names if n.startswith("harbor_local_sandbox")]
    assert not offending, "\n".join(offending)
