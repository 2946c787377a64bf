"""The Ray backend (``environment_type="ray"``): the local sandbox on the nodes of a Ray cluster.

On a cluster of three simulated worker nodes on this machine (``ray.cluster_utils.Cluster``; the
head node takes no sandboxes), with 1, 2 and 3 CPUs:

* a CPU GRPO step of TRL's ``GRPOTrainer`` on ``HarborSpec(environment_type="ray")``, unchanged: its
  tool calls run on the nodes and its rewards follow what they did;
* a batch of 24 rollouts of the bundled suite (12 tasks, each its oracle's and doing nothing),
  through trl-harbor's own episodes and grading (the verifier in the local sandbox's view, held on
  the node): the rewards are the local backend's, task by task; every node ran sandboxes, never more
  at once than its CPUs (Ray's accounting of the tasks' ``cpus``), and no two started at once on a
  node (``max_starts_per_node=1``);
* a task's image is built once per node: with a cache folder per node (``{node_id}`` in the
  inner backend's ``cache_dir``), each node that ran the task holds one build of it, however many
  of its sandboxes ran there;
* a node lost mid-batch, through the tool path TRL drives (``HarborBashEnv``): its rollouts are the
  infrastructure's (reward ``None``, never 0), the others are graded, the next batch runs on the
  remaining nodes, and afterwards no sandbox actor is alive and no sandbox process is left;
* a driver killed outright: its actors die with it, and its sandboxes' processes with them;
* the contract: a ``RayEnvironment`` meets the protocols grading reads (``tests/test_contract.py``).

Run as root (the local sandbox's task images) with Ray installed (``scripts/bootstrap.sh`` installs
the sandbox package's ``ray`` extra); elsewhere they skip, saying which is missing.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest
from conftest import BUNDLED_SUITE, GOLD_TASK, no_process_left

from sandbox_helpers import make_task, recording_bash_env
from trl_harbor import runtime
from trl_harbor.options import HarborOptions
from trl_harbor.rollout import contract
from trl_harbor.rollout.backends import resolve_backend
from trl_harbor.rollout.episode import Episode

pytestmark = [
    pytest.mark.local,
    pytest.mark.ray,
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None, reason="Ray is not installed (scripts/bootstrap.sh installs it)"
    ),
    pytest.mark.skipif(os.geteuid() != 0, reason="the local sandbox's task images need root here"),
]

#: The worker nodes' CPUs (the head node has none: it takes no sandboxes).
NODE_CPUS = (1, 2, 3)
#: The Ray actor class that holds one sandbox.
HOST_CLASS = "_SandboxHost"


# ── without a cluster ─────────────────────────────────────────────────────────────────


def test_no_cluster_is_an_error_that_names_the_option() -> None:
    """A driver with no address, no RAY_ADDRESS and no cluster on its machine is told how to get one.

    First in the module: Ray's ``"auto"`` finds a cluster running anywhere on this machine, the
    simulated one of the tests below included.
    """
    script = textwrap.dedent(
        """
        from harbor_local_sandbox.ray_cluster import RayClusterUnavailableError, connect
        try:
            connect()
        except RayClusterUnavailableError as exc:
            print(exc)
        """
    )
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    # Ray finds a cluster started on this machine through its temp folder: a fresh one has none.
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / f"no-ray-{uuid.uuid4().hex[:8]}"
    scratch.mkdir()
    try:
        out = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
            env={**env, "RAY_TMPDIR": str(scratch), "TMPDIR": str(scratch)},
        )  # fmt: skip
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert "no Ray cluster found" in out.stdout and "--ek address=" in out.stdout and "RAY_ADDRESS" in out.stdout, (
        out.stdout + out.stderr[-2000:]
    )


# ── the cluster ───────────────────────────────────────────────────────────────────────


@pytest.fixture(scope="module")
def cluster():
    """Three simulated worker nodes and a head without CPUs; this process is the driver."""
    import ray
    from ray.cluster_utils import Cluster

    sigterm = signal.getsignal(signal.SIGTERM)  # ray.init replaces it, and keeps it after shutdown
    made = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [made.add_node(num_cpus=cpus) for cpus in NODE_CPUS]
    made.wait_for_nodes()
    ray.init(address=made.address, logging_level="WARNING")
    try:
        yield made, nodes
    finally:
        ray.shutdown()
        made.shutdown()
        signal.signal(signal.SIGTERM, sigterm)  # the later tests' process as it was
        # What actors killed outright left (their sandboxes' trees and mounts) goes now, not at the next
        # sandbox this process starts (it sweeps once per process): later tests see a clean host.
        assert not _stale_after_sweep()


def _alive_hosts() -> list[dict]:
    """The sandbox actors Ray counts as alive (the GCS's table: the state API needs the dashboard)."""
    import ray

    return [
        actor
        for actor in ray._private.state.actors().values()
        if actor["ActorClassName"].endswith(HOST_CLASS) and actor["State"] != "DEAD"
    ]


def _wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals that hold at one moment."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


# ── rollouts through trl-harbor's episodes ──────────────────────────────────────────────


async def _rollout(task_dir: Path, backend, options: HarborOptions, workdir: Path, *, oracle: bool, marker: str):
    """One rollout as ``trl-harbor check`` runs it (its oracle, or nothing), graded by trl-harbor's grading.

    Every rollout leaves a process named ``marker`` running in its sandbox, for the check that none outlives it.

    Returns:
        ``(reward, placement, stopped_at)``; placement is ``None`` on the local backend.
    """
    from harbor.agents.oracle import OracleAgent
    from harbor.models.agent.context import AgentContext
    from harbor.models.task.task import Task

    task = Task(task_dir)
    role = "oracle" if oracle else "nop"
    episode = Episode(task, backend, options, workdir / f"{task.short_name}-{role}-{uuid.uuid4().hex[:6]}")
    try:
        await episode.provision()
        assert episode.failure is None, episode.failure
        environment = episode.environment
        await episode.exec(f"(exec -a {marker} sleep 600) >/dev/null 2>&1 &", timeout=30)
        if oracle:
            agent = OracleAgent(logs_dir=episode.paths.agent_dir, task_dir=task.task_dir, trial_paths=episode.paths)
            await agent.run(episode.instruction, environment, AgentContext())
        verification = await episode.grade()
        return verification.reward, getattr(environment, "placement", None), time.time()
    finally:
        await episode.stop()


def _batch(task_dirs: list[Path], environment_type: str, backend_options: dict, workdir: Path, marker: str) -> list:
    options = HarborOptions(backend_options=backend_options)
    backend = resolve_backend(environment_type, backend_options)

    async def every() -> list:
        limit = asyncio.Semaphore(12)  # the driver's own bound; Ray's accounting bounds each node

        async def one(task_dir: Path, oracle: bool):
            async with limit:
                return await _rollout(task_dir, backend, options, workdir, oracle=oracle, marker=marker)

        return list(await asyncio.gather(*(one(d, oracle) for d in task_dirs for oracle in (True, False))))

    return runtime.run(every())


def test_a_batch_spreads_over_the_nodes_by_their_resources_and_scores_as_the_local_backend(
    cluster, tmp_path: Path
) -> None:
    _, nodes = cluster
    capacity = {node.node_id: cpus for node, cpus in zip(nodes, NODE_CPUS, strict=True)}
    tasks = sorted(p for p in BUNDLED_SUITE.iterdir() if p.is_dir())[:12]
    marker = f"trl-ray-batch-{uuid.uuid4().hex[:8]}"

    on_ray = _batch(tasks, "ray", {"max_starts_per_node": 1}, tmp_path, marker)
    on_local = _batch(tasks, "local", {}, tmp_path, marker)

    assert len(on_ray) == 24
    rewards = [reward for reward, _, _ in on_ray]
    assert rewards == [reward for reward, _, _ in on_local], list(zip(tasks, rewards[::2], rewards[1::2], strict=True))
    assert set(rewards) == {0.0, 1.0}  # graded, both ways (an oracle's 1, nothing's 0), not skipped
    # Spread over every node, never more sandboxes at once on a node than its CPUs (each task asks for 1).
    held, starts = defaultdict(list), defaultdict(list)
    for _, placement, stopped_at in on_ray:
        assert placement.node_id in capacity, placement  # never the head, which has no CPUs
        held[placement.node_id].append((placement.started_at, stopped_at))
        starts[placement.node_id].append((placement.started_at, placement.started_at + placement.start_sec))
    assert set(held) == set(capacity), {node[:8]: len(v) for node, v in held.items()}
    for node, intervals in held.items():
        assert _max_overlap(intervals) <= capacity[node], (node, intervals)
        assert _max_overlap(starts[node]) == 1, (node, starts[node])  # max_starts_per_node=1
    assert _wait(lambda: not _alive_hosts(), 30), _alive_hosts()
    assert not no_process_left(marker, within=10)


def test_a_cpu_grpo_step_runs_its_tools_on_the_nodes(cluster, tmp_path: Path) -> None:
    """``HarborSpec(environment_type="ray")`` in TRL's GRPOTrainer, unchanged: tools run on the nodes, rewards follow."""
    from conftest import GOLD_ANSWER, tiny_grpo_trainer

    from trl_harbor import HarborBashEnv, HarborSpec, close_all
    from trl_harbor.testing import tool_call_text

    _, nodes = cluster
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copytree(BUNDLED_SUITE / GOLD_TASK, suite / GOLD_TASK)
    good_command = f"echo -n {GOLD_ANSWER} > /workdir/answer.txt"
    bad_command = "echo -n 0 > /workdir/answer.txt"
    ran: list[tuple[int, str, str]] = []

    RecordingBashEnv = recording_bash_env(
        lambda env, command, output: ran.append((id(env), command, env._episode.environment.placement.node_id))
    )

    spec = HarborSpec(suite, agent=RecordingBashEnv, environment_type="ray", preflight=True)
    harbor_reward = spec.reward_funcs
    scored: list[tuple[list, list]] = []

    def recorded_reward(completions, environments=None, **kwargs):
        rewards = harbor_reward(completions=completions, environments=environments, **kwargs)
        scored.append((rewards, [[c for e, c, _ in ran if e == id(env)] for env in environments]))
        return rewards

    calls = [tool_call_text("bash", {"command": c}) for c in (good_command, bad_command)]
    trainer = tiny_grpo_trainer(tmp_path, spec, calls, HarborBashEnv.PROMPT_SUFFIX, [recorded_reward])
    try:
        trainer.train()
    finally:
        close_all()
    assert ran, "the rigged policy must have called the bash tool"
    assert {node for _, _, node in ran} <= {node.node_id for node in nodes}, ran
    rewards, commands = scored[0]
    assert len(rewards) == 2
    for reward, cmds in zip(rewards, commands, strict=True):
        assert reward == (1.0 if cmds and cmds[-1] == good_command else 0.0), (reward, cmds)


# ── images: once per node ─────────────────────────────────────────────────────────────────


def test_check_runs_on_the_cluster_unchanged(cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``trl-harbor check -e ray``: the bundled gold task's oracle scores 1 and doing nothing 0, on a node."""
    from trl_harbor.cli import main as cli_main

    made, _ = cluster
    suite = tmp_path / "suite"
    shutil.copytree(BUNDLED_SUITE / GOLD_TASK, suite / GOLD_TASK)
    assert cli_main(["check", str(suite), "-e", "ray", "--ek", f"address={made.address}", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["passed"], report["failed"]) == (1, 0), report
    assert not _alive_hosts()


def test_a_tasks_image_is_built_once_per_node(cluster, tmp_path: Path) -> None:
    """With a cache folder per node, each node that ran the task holds one build of its image."""
    from harbor_local_sandbox.oci import ImageStore
    from registry import base_image_archive

    _, nodes = cluster
    base = "localhost/trl-harbor-ray-test/debian:bookworm"
    caches = tmp_path / "caches"
    archive = base_image_archive()
    for node in nodes:  # a node's own cache starts with the base image only (loaded: no registry here)
        asyncio.run(ImageStore(caches / node.node_id).load_archive(archive, base))
    task = make_task(
        tmp_path / "suite", name="per-node", dockerfile=f"FROM {base}\nWORKDIR /workdir\nRUN echo built > /built\n"
    )
    options = {"inner_kwargs": {"cache_dir": f"{caches}/{{node_id}}"}, "max_starts_per_node": 2}
    try:
        results = _batch([task] * 4, "ray", options, tmp_path, f"trl-ray-images-{uuid.uuid4().hex[:8]}")
        assert [reward for reward, _, _ in results] == [1.0, 0.0] * 4
        ran = defaultdict(int)
        for _, placement, _ in results:
            ran[placement.node_id] += 1
        assert sum(ran.values()) == 8 and len(ran) >= 2, ran
        keys = set()
        for node in nodes:
            built = ImageStore(caches / node.node_id).images()
            assert len(built) == (1 if node.node_id in ran else 0), (node.node_id, ran, built)
            keys.update(image.record.key for image in built)
        assert len(keys) == 1  # the same content, the same image, on every node
    finally:
        for node in nodes:
            ImageStore(caches / node.node_id).release_mounts()


# ── faults ──────────────────────────────────────────────────────────────────────────────


def test_a_node_lost_mid_batch_loses_only_its_rollouts_and_the_next_batch_runs(cluster) -> None:
    from harbor_local_sandbox._binaries import state_root

    from trl_harbor import HarborBashEnv
    from trl_harbor.training.env import release

    made, _ = cluster
    doomed = made.add_node(num_cpus=2)
    made.wait_for_nodes()
    marker = f"trl-ray-lost-{uuid.uuid4().hex[:8]}"
    task_dir = str(BUNDLED_SUITE / GOLD_TASK)
    answer = (BUNDLED_SUITE / GOLD_TASK / "solution" / "solve.sh").read_text()

    try:
        # 1 + 2 + 3 + 2 CPUs: eight sandboxes of one CPU all run at once, two on the doomed node.
        first = [HarborBashEnv("ray", command_timeout_sec=60) for _ in range(8)]
        for env in first:
            env.reset(task_dir=task_dir)
        for env in first:  # every sandbox up, each with a process of its own left running
            assert env.bash(f"(exec -a {marker} sleep 600) >/dev/null 2>&1 & echo up").strip() == "up"
        placed = [env._episode.environment.placement for env in first]
        lost = [p.node_id == doomed.node_id for p in placed]
        assert sum(lost) == 2, [p.node_id[:8] for p in placed]
        pids = {p.pid for p in placed}
        made.remove_node(doomed)
        outputs = [env.bash(answer) for env in first]  # the oracle's solution, as the policy's tool call
        rewards = [env.reward for env in first]
        for was_lost, output, reward in zip(lost, outputs, rewards, strict=True):
            if was_lost:
                assert "will not be scored" in output, output
                assert reward is None  # the infrastructure's: skipped, never the policy's 0
            else:
                assert reward == 1.0, output
        for env in first:
            release(env)

        # The next batch, on the six CPUs left.
        second = [HarborBashEnv("ray", command_timeout_sec=2 if i == 0 else 60) for i in range(6)]
        for env in second:
            env.reset(task_dir=task_dir)
        rewards = []
        # A command past its timeout is the policy's (stopped on the node, the rollout goes on), not a lost node.
        assert "timed out after 2 s" in second[0].bash("sleep 30"), second[0]._episode.failure
        for env in second:
            env.bash(f"(exec -a {marker} sleep 600) >/dev/null 2>&1 &")
            output = env.bash(answer)
            rewards.append(env.reward)
            placement = env._episode.environment.placement
            assert placement.node_id != doomed.node_id, output
            pids.add(placement.pid)
            release(env)
        assert rewards == [1.0] * 6
    finally:
        from trl_harbor import close_all

        close_all()
    assert _wait(lambda: not _alive_hosts(), 30), _alive_hosts()
    assert not no_process_left(marker, within=15)
    # No sandbox tree of any of the actors is left on the machine: the doomed node's were swept by the
    # next sandboxes started here (their owners dead), the others removed at their stop.
    left = [entry.name for entry in state_root().iterdir() if entry.name.split("-", 1)[0] in {str(p) for p in pids}]
    assert not left, left


DRIVER = textwrap.dedent(
    """
    import sys
    from trl_harbor import HarborBashEnv

    env = HarborBashEnv("ray")
    env.reset(task_dir=sys.argv[1])
    print(env.bash(f"(exec -a {sys.argv[2]} sleep 600) >/dev/null 2>&1 & echo up").strip(), flush=True)
    sys.stdin.read()
    """
)


def test_a_killed_driver_leaves_no_actor_and_no_sandbox(cluster) -> None:
    made, _ = cluster
    marker = f"trl-ray-driver-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "RAY_ADDRESS": made.address}  # the driver finds the cluster by RAY_ADDRESS alone
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(BUNDLED_SUITE / GOLD_TASK), marker],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert driver.stdout.readline().strip() == "up", driver.stderr.read() if driver.poll() is not None else ""
        assert len(_alive_hosts()) == 1
        driver.send_signal(signal.SIGKILL)  # no exit hook of the driver's runs
        driver.wait(10)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert _wait(lambda: not _alive_hosts(), 60), _alive_hosts()
    assert not no_process_left(marker, within=30)
    # Its sandbox's tree and mounts (its actor killed outright) are the next sweep's, as when the next
    # sandbox starts on the machine: after it, no tree or mount of a dead owner is left.
    assert not _stale_after_sweep()


def _stale_after_sweep() -> list[str]:
    """Sweep the trees of sandboxes whose owner died (``sweep_stale``); what of them is still there."""
    from harbor_local_sandbox._binaries import state_root
    from harbor_local_sandbox._lifetime import sweep_stale

    sweep_stale()
    root = state_root()
    dead = [e.name for e in root.iterdir() if e.name.split("-", 1)[0].isdigit() and not _pid_alive(e.name)]
    mounts = [
        line.split()[4]
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if line.split()[4].startswith(f"{root}/") and not _pid_alive(line.split()[4][len(f"{root}/") :])
    ]
    return dead + mounts


def _pid_alive(name: str) -> bool:
    owner = name.split("-", 1)[0]
    return not owner.isdigit() or Path(f"/proc/{owner}").exists()


# ── the contract ──────────────────────────────────────────────────────────────────────────


def test_a_ray_environment_meets_the_protocols_grading_reads(tmp_path: Path) -> None:
    from harbor.models.task.task import Task
    from harbor.models.trial.paths import TrialPaths
    from harbor_local_sandbox.ray_cluster import RayEnvironment, RayHarborEnvironment

    backend = resolve_backend("ray")
    assert backend.environment_class is RayEnvironment and backend.kind == "ray"
    assert not backend.supports_compose and backend.image_store() is None  # images are the nodes'
    task = Task(BUNDLED_SUITE / GOLD_TASK)
    env = backend.create(task, TrialPaths(trial_dir=tmp_path / "trial"), session_id="contract")
    for protocol in (contract.IsolatedVerification, contract.Liveness, contract.ExhaustionReport, contract.NativeSeal):
        assert isinstance(env, protocol), protocol.__name__
    assert contract.isolating(env)
    assert not runtime.run(env.alive())  # not started: no sandbox, no error
    off = resolve_backend("ray", {"inner_kwargs": {"verifier_isolation": False}})
    assert not contract.isolating(off.create(task, TrialPaths(trial_dir=tmp_path / "off"), session_id="off"))
    # Harbor's interface only, for an inner backend without the local sandbox's grading support.
    plain = resolve_backend(f"{RayHarborEnvironment.__module__}:RayHarborEnvironment")
    bare = plain.create(task, TrialPaths(trial_dir=tmp_path / "plain"), session_id="plain")
    assert isinstance(bare, contract.Liveness)
    assert not isinstance(bare, contract.IsolatedVerification) and not isinstance(bare, contract.NativeSeal)


def test_options_and_errors_name_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from harbor.models.task.task import Task
    from harbor.models.trial.paths import TrialPaths

    task = Task(BUNDLED_SUITE / GOLD_TASK)
    with pytest.raises(ValueError, match="Unknown option 'cluster'"):
        resolve_backend("ray", {"cluster": "x"}).create(task, TrialPaths(trial_dir=tmp_path / "a"), session_id="a")
    with pytest.raises(ValueError, match="lacks verifier_view.*RayHarborEnvironment"):
        resolve_backend("ray", {"inner": "harbor.environments.docker.docker:DockerEnvironment"}).create(
            task, TrialPaths(trial_dir=tmp_path / "b"), session_id="b"
        )
    # Without Ray: the alias says what to install (the module is looked for, never imported).
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ValueError, match=r"needs the ray package.*pip install 'trl-harbor\[ray\]'"):
        resolve_backend("ray")
