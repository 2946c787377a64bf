"""No-network tasks on an offline Docker host: refused when the spec is built, naming the images.

Harbor's ``docker`` backend enforces ``network_mode = "no-network"`` (and allowlists) with an
egress-control sidecar; it turns it on only when its kernel probe (``alpine``, pinned by
digest) runs and its sidecar image (built with ``docker buildx`` from ``gogost/gost``, pinned
by digest) exists or can be built. The tests' daemon reaches no registry and has no buildx, like
an offline Debian host, so without the preflight every such task is refused by Harbor when its
sandbox is created; ``trl_harbor.rollout.preflight.docker_network_problem`` says so when the first environment is built.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from conftest import BUNDLED_SUITE, GOLD_TASK
from docker_daemon import public_copy

from trl_harbor import HarborSpec, close_all
from trl_harbor.rollout.preflight import BackendUnavailableError

pytestmark = pytest.mark.docker


@pytest.fixture
def fresh_egress_probe():
    """Harbor keeps its kernel probe's answer per process: let this test's spec ask the daemon again."""
    from harbor.environments.docker.docker import DockerEnvironment

    from trl_harbor.rollout import preflight

    DockerEnvironment._egress_control_kernel_support.__func__.cache_clear()
    preflight._PASSED.clear()
    yield DockerEnvironment
    DockerEnvironment._egress_control_kernel_support.__func__.cache_clear()


def test_no_network_tasks_are_refused_before_the_first_sandbox_naming_the_images(
    docker_daemon,
    fresh_egress_probe,
    tmp_path: Path,
) -> None:
    docker_env = fresh_egress_probe
    probe = docker_env._EGRESS_CONTROL_KERNEL_PROBE_IMAGE
    with pytest.raises(BackendUnavailableError) as caught:
        HarborSpec(BUNDLED_SUITE, environment_type="docker", preflight=True).environment_factory()
    message = str(caught.value)
    assert "cannot run 13 of these 15 tasks" in message and "network_mode='no-network'" in message, message
    assert "building_b_humidity" in message and "orders_count" not in message, message
    assert f"{probe} (Harbor's kernel probe, run by digest): not in the daemon" in message, message
    assert "harbor-prebuilt:harbor-docker-egress-control-sidecar--" in message and "gogost/gost:" in message, message
    assert "registry-mirrors" in message and "environment_type='local'" in message, message
    # The public tasks alone build; a task whose verifier phase alone is closed is refused too.
    HarborSpec(BUNDLED_SUITE, environment_type="docker", preflight=True, indices=[8]).environment_factory()
    suite = tmp_path / "suite"
    public_copy(BUNDLED_SUITE / GOLD_TASK, suite / GOLD_TASK)
    toml = suite / GOLD_TASK / "task.toml"
    toml.write_text(toml.read_text().replace("[verifier]", '[verifier]\nnetwork_mode = "no-network"', 1))
    with pytest.raises(
        BackendUnavailableError, match=r"cannot run 1 of these 1 tasks on this machine \(building_b_humidity\)"
    ):
        HarborSpec(suite, environment_type="docker", preflight=True).environment_factory()
    # What Harbor itself does without the preflight: it refuses the task when its sandbox is created.
    spec = HarborSpec(BUNDLED_SUITE, environment_type="docker", preflight=False, indices=[0])
    env = spec.environment_factory()
    try:
        env.reset(task_dir=str(spec.task_dirs[0]))
        assert env.reward is None
        assert "network_mode='no-network' is not supported" in (env.verification.reason or ""), env.verification
    finally:
        close_all()


def test_the_sidecar_is_named_as_harbor_names_it(docker_daemon, fresh_egress_probe) -> None:
    """A sidecar image loaded under the name the error gives is the one Harbor uses (it builds nothing)."""
    from harbor.environments.docker.utils import default_docker_platform, ensure_docker_image_built

    from trl_harbor.rollout.preflight import _sidecar_image

    docker_env = fresh_egress_probe
    name, base = _sidecar_image(docker_env)
    assert name and name.startswith("harbor-prebuilt:harbor-docker-egress-control-sidecar--"), name
    assert base and base.startswith("gogost/gost:") and "@sha256:" in base, base
    docker_daemon.docker("tag", "debian:bookworm-slim", name)
    try:
        with pytest.raises(BackendUnavailableError) as caught:
            HarborSpec(BUNDLED_SUITE, environment_type="docker", preflight=True).environment_factory()
        assert "harbor-docker-egress-control-sidecar--" not in str(caught.value)  # found: only the probe is missing
        assert docker_env._EGRESS_CONTROL_KERNEL_PROBE_IMAGE in str(caught.value)

        async def harbors_name() -> str:
            return await ensure_docker_image_built(
                docker_name=docker_env._EGRESS_CONTROL_SIDECAR_DOCKER_NAME,
                docker_build_context=docker_env._EGRESS_CONTROL_SIDECAR_CONTEXT_PATH,
                dockerfile_path=docker_env._egress_control_sidecar_dockerfile_path(),
                build_args={},
                platform=await default_docker_platform(),
            )

        assert asyncio.run(harbors_name()) == name  # no buildx here: a wrong name would have tried a build
    finally:
        docker_daemon.docker("rmi", name)
