"""The contract between the rollout core and a backend (trl_harbor.rollout.contract), and the facts read once.

The local sandbox meets every protocol structurally (it imports nothing of trl-harbor); Harbor's Docker
backend meets none, and grading then takes the path Harbor's interface alone allows. What a backend is
(its kind, compose, its image cache) comes from its class, whatever the ``environment_type`` string.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from sandbox_helpers import make_task, open_env, run
from trl_harbor.rollout import contract
from trl_harbor.rollout.backends import resolve_backend

PACKAGE = Path(__file__).resolve().parents[1] / "packages" / "harbor-local-sandbox" / "src" / "harbor_local_sandbox"
INSTANCE_PROTOCOLS = [contract.IsolatedVerification, contract.Liveness, contract.ExhaustionReport, contract.NativeSeal]
CLASS_PROTOCOLS = [contract.ImageCache, contract.IdleResources, contract.ComposeDeclaration]


def test_the_local_sandbox_class_meets_the_class_protocols_and_docker_none() -> None:
    local = resolve_backend("local").environment_class
    docker = resolve_backend("docker").environment_class
    for protocol in CLASS_PROTOCOLS:
        assert isinstance(local, protocol), protocol.__name__
        assert not isinstance(docker, protocol), protocol.__name__
    for protocol in INSTANCE_PROTOCOLS:  # what a sandbox offers, on neither class object
        assert not isinstance(docker, protocol), protocol.__name__


def test_backend_facts_come_from_the_class_not_the_string() -> None:
    docker = resolve_backend("docker")
    assert docker.kind == "docker" and docker.supports_compose and docker.image_store() is None
    for name in ("local", "harbor_local_sandbox.local:LocalEnvironment"):
        backend = resolve_backend(name)
        assert backend.kind == "local", name  # the alias or the import path: the same backend
        assert backend.supports_compose and backend.image_store() is not None, name  # its services too
        assert isinstance(backend.environment_class, contract.ComposeCheck), name
    subclass = resolve_backend("harbor_local_sandbox.latency:LatencyLocalEnvironment")
    assert subclass.kind == "local-latency"  # its own type(), and the local sandbox's capabilities
    assert subclass.supports_compose and subclass.image_store() is not None
    assert not isinstance(docker.environment_class, contract.ComposeCheck) and docker.compose_problems(Path()) == []


def test_the_image_store_follows_the_backend_options(tmp_path: Path) -> None:
    store = resolve_backend("local", {"cache_dir": str(tmp_path / "cache"), "host_trust": False}).image_store()
    assert store.cache_dir == tmp_path / "cache"
    again = resolve_backend("local", {"cache_dir": str(tmp_path / "cache"), "host_trust": False}).image_store()
    assert again is store  # the process's one store for those options, which the sandboxes use


@pytest.mark.local
def test_a_local_sandbox_and_its_verifier_view_meet_the_instance_protocols(tmp_path: Path) -> None:
    task = make_task(tmp_path / "suite", name="contract")

    async def check() -> None:
        env = open_env(task, tmp_path)
        await env.start(force_build=False)
        for protocol in INSTANCE_PROTOCOLS:
            assert isinstance(env, protocol), protocol.__name__
        assert contract.isolating(env)
        async with env.verifier_view() as view:
            assert isinstance(view, contract.VerifierView) and isinstance(view.concealed, tuple)
            assert (await view.exec("echo view")).stdout.strip() == "view"
        assert await env.alive()
        await env.stop(delete=True)
        assert not await env.alive()

    run(check())


def test_the_refused_download_errors_are_marked() -> None:
    from harbor_local_sandbox import _hostfs

    marked = [
        cls
        for cls in vars(_hostfs).values()
        if isinstance(cls, type) and issubclass(cls, Exception) and "unsafe" in vars(cls)
    ]
    assert marked, "the local sandbox's refused downloads carry unsafe = True"
    for cls in marked:
        assert isinstance(cls.__new__(cls), contract.RefusedDownload)


#: The ``getattr``/``hasattr`` calls of the rollout core that probe no sandbox: (file, what is probed) -> why.
NOT_A_SANDBOX = {
    ("__init__.py", "import_module(module)"): "the package's lazy names (a module's attribute)",
    ("sources.py", "self"): "a dataclass's own fields",
    ("sources.py", "given"): "a dataclass's fields, read from a compatible object",
    ("sources.py", "task_id"): "Harbor's task ids (a git, package or local id)",
    ("outcome.py", "self"): "a dataclass's own fields",
    ("preflight.py", "docker_env"): "Harbor's Docker class, for a constant older Harbor releases lack",
    ("preflight.py", "o"): "a rollout's outcome (None or a Verification)",
}


def test_grading_probes_no_backend_member_by_name() -> None:
    """No ``getattr`` probing of a sandbox is left in the rollout core: every extension is a protocol. Every
    file of ``rollout/`` is read (a new one included); the probes of other objects are listed above, with why."""
    core = Path(__file__).resolve().parents[1] / "src" / "trl_harbor" / "rollout"
    paths = sorted(core.rglob("*.py"))
    assert {"episode.py", "grading.py", "steps.py"} <= {path.name for path in paths}, core
    probes, seen = [], set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr") and node.args:
                key = (path.relative_to(core).as_posix(), ast.unparse(node.args[0]))
                seen.add(key)
                if key not in NOT_A_SANDBOX:
                    probes.append(f"{key[0]}:{node.lineno}: {ast.unparse(node)}")
    assert not probes, "\n".join(probes)
    assert not set(NOT_A_SANDBOX) - seen, f"listed but gone (remove them): {sorted(set(NOT_A_SANDBOX) - seen)}"


def test_the_package_imports_nothing_of_trl_harbor() -> None:
    offending = []
    paths = sorted(PACKAGE.rglob("*.py"))  # every module, in sub-folders too
    assert PACKAGE / "local.py" in paths, PACKAGE
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offending += [
                f"{path.relative_to(PACKAGE)}: {n}" for n in names if n.split(".")[0] in ("trl_harbor", "trl")
            ]
    assert not offending, offending


def test_without_the_package_local_names_it_at_spec_build_and_docker_resolves(without_the_local_sandbox) -> None:
    from trl_harbor import HarborSpec

    with pytest.raises(
        ValueError, match=r"harbor-local-sandbox package, which is not installed: pip install 'trl-harbor\[local\]'"
    ):
        HarborSpec("examples/tasks", environment_type="local")
    docker = resolve_backend("docker")
    assert docker.kind == "docker" and docker.image_store() is None
