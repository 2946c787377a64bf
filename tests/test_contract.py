"""The contract between the rollout core and a backend (trl_harbor.rollout.contract), and the facts read once.

The local sandbox meets every protocol structurally (it imports nothing of trl-harbor); Harbor's Docker
backend meets none, and grading then takes the path Harbor's interface alone allows. What a backend is
(its kind, compose, its image cache) comes from its class, whatever the ``environment_type`` string.
"""

from __future__ import annotations

import ast
import warnings
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
        assert not backend.supports_compose and backend.image_store() is not None, name
    subclass = resolve_backend("harbor_local_sandbox.latency:LatencyLocalEnvironment")
    assert subclass.kind == "local-latency"  # its own type(), and the local sandbox's capabilities
    assert not subclass.supports_compose and subclass.image_store() is not None
    with warnings.catch_warnings():  # the old import path, kept for one release, warns
        warnings.simplefilter("ignore", DeprecationWarning)
        legacy = resolve_backend("trl_harbor.sandboxes.local:LocalEnvironment")
        assert legacy.environment_class is resolve_backend("local").environment_class
    assert legacy.kind == "local"


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


def test_grading_probes_no_backend_member_by_name() -> None:
    """No ``getattr`` probing of a sandbox is left in the rollout core's grading: every extension is a protocol."""
    core = Path(__file__).resolve().parents[1] / "src" / "trl_harbor" / "rollout"
    probes = []
    for path in [core / f"{name}.py" for name in ("episode", "grading", "seal", "steps", "integrity", "policy")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr"):
                probes.append(f"{path.name}:{node.lineno}")
    assert not probes, probes


def test_the_package_imports_nothing_of_trl_harbor() -> None:
    offending = []
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offending += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("trl_harbor", "trl")]
    assert not offending, offending


def test_without_the_package_local_names_it_at_spec_build_and_docker_resolves(without_the_local_sandbox) -> None:
    from trl_harbor import HarborSpec

    with pytest.raises(
        ValueError, match=r"harbor-local-sandbox package, which is not installed: pip install 'trl-harbor\[local\]'"
    ):
        HarborSpec("examples/tasks", environment_type="local")
    docker = resolve_backend("docker")
    assert docker.kind == "docker" and docker.image_store() is None
