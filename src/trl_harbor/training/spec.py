"""``HarborSpec``: one object that plugs a Harbor task suite into TRL's ``GRPOTrainer``.

.. code-block:: python

    from trl import GRPOConfig, GRPOTrainer
    from trl_harbor import HarborSpec

    spec = HarborSpec("path/or/hf-dataset-id", agent="bash", num_tasks=64)
    trainer = GRPOTrainer(
        model="Qwen/Qwen3-4B",
        args=GRPOConfig(num_generations=8, max_tool_calling_iterations=25),
        train_dataset=spec.train_dataset,
        environment_factory=spec.environment_factory,
        reward_funcs=spec.reward_funcs,
    )

The suite is found and every task validated when the spec is built, so a malformed suite fails
at once; the backend is checked only when the environment factory is first used (the trainer's
construction), so a dataset builds without one. The three properties are computed on first
access (``datasets`` is imported only by ``train_dataset``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trl_harbor.loop.rollout_func import LoopRolloutFunc, loop_agent_name, loop_reward
from trl_harbor.loop.terminus import TerminusOptions
from trl_harbor.options import OPTION_NAMES, HarborOptions, merge_loose_options
from trl_harbor.rollout.backends import Backend, resolve_backend
from trl_harbor.rollout.preflight import check_backend, check_task_configs, preflight_enabled
from trl_harbor.rollout.sources import SuiteSelection, parse_dataset, resolve_suite
from trl_harbor.rollout.suite import TaskInfo, TaskSuiteError, load_tasks, metadata_columns, select_tasks
from trl_harbor.training.agents import resolve_agent
from trl_harbor.training.env import HarborEnv, check_hooks, with_environment_reward
from trl_harbor.training.rewards import harbor_reward

if TYPE_CHECKING:
    from datasets import Dataset

    from trl_harbor.rollout.suite_lock import LockedSuite
    from trl_harbor.training.mix import HarborMix

__all__ = ["BackendCheck", "EnvironmentFactory", "HarborSpec", "check_runnable", "split_env_kwargs"]


def split_env_kwargs(
    options: HarborOptions | None, env_kwargs: dict[str, Any] | None
) -> tuple[HarborOptions, dict[str, Any]]:
    """Separate rollout options from a harness's own constructor arguments.

    Args:
        options: The options object, if any.
        env_kwargs: Keyword arguments for every environment: the harness's own go to it; fields of
            :class:`HarborOptions` (``command_timeout_sec``, ...) override ``options``, deprecated
            (:func:`~trl_harbor.options.merge_loose_options`).

    Returns:
        ``(options, harness keyword arguments)``.
    """
    given = dict(env_kwargs or {})
    loose = {key: given.pop(key) for key in list(given) if key in OPTION_NAMES}
    return merge_loose_options(options, loose, "HarborSpec(env_kwargs=...)", stacklevel=4), given


def check_runnable(tasks: Sequence[TaskInfo], env_cls: type[HarborEnv] | None, backend: Backend) -> None:
    """Refuse, when the spec is built, tasks that the harness or the backend cannot run.

    Args:
        tasks: The selected tasks.
        env_cls: The harness (``None``: a loop-owning agent).
        backend: The backend.

    Raises:
        TaskSuiteError: Naming every such task, why, and the fix.
    """
    problems = []
    for task in tasks:
        if task.steps and env_cls is None:  # a loop-owning agent (terminus-2)
            problems.append(
                f"{task.path}/task.toml: [[steps]] ({task.steps} steps): a loop-owning agent (terminus-2) "
                "trains on single-step tasks only for now. Fix: a harness with `submit_step` "
                "(agent='bash_steps'), or leave the task out."
            )
        elif task.steps and not callable(getattr(env_cls, "submit_step", None)):
            problems.append(
                f"{task.path}/task.toml: [[steps]] ({task.steps} steps) needs a harness with a "
                f"`submit_step` tool, and {env_cls.__name__} has none. Fix: agent='bash_steps', or "
                "add trl_harbor.StepsMixin to your harness."
            )
        if task.compose and not backend.supports_compose:
            problems.append(
                f"{task.path}/environment/docker-compose.yaml: the {backend.kind} backend runs one container, "
                "not compose services (the sidecars would be silently missing). Fix: "
                "environment_type='docker' (or another backend that runs compose), or leave the task out."
            )
        elif task.compose:  # what of the file the backend does not run, by field and fix
            problems += backend.compose_problems(task.path / "environment")
    if problems:
        raise TaskSuiteError(f"{len(problems)} task(s) cannot run here:\n" + "\n".join(f"  - {p}" for p in problems))


class BackendCheck:
    """The backend preflight a spec owes its user, run once, when its sandboxes are first needed.

    Building a spec (and its ``train_dataset``) needs no backend, as in ``trl.experimental.harbor``;
    the check runs when the environment factory or the rollout function is first used — the
    trainer's construction, ``trl-harbor check``/``eval`` — so a backend that cannot start any
    sandbox still fails before the first step, with its cause and fix
    (:func:`trl_harbor.rollout.preflight.check_backend`). Shared by every copy of a factory; a process
    that unpickles one checks again (a success is remembered per process).

    Args:
        backend: The backend.
        task_dirs: The tasks that will run on it (Docker checks their network policies).
        enabled: ``False``: never check; ``None``: unless ``TRL_HARBOR_PREFLIGHT=0`` (read
            when the check runs).
    """

    def __init__(self, backend: Backend, task_dirs: Sequence[Path], enabled: bool | None = None) -> None:
        self.backend = backend
        self.task_dirs = tuple(task_dirs)
        self.enabled = enabled
        self.passed = False

    def __call__(self) -> None:
        """Run the check unless it passed already (or is disabled).

        Raises:
            trl_harbor.rollout.preflight.BackendUnavailableError: When the backend cannot start sandboxes here.
        """
        if self.passed or not preflight_enabled(self.enabled):
            return
        check_backend(self.backend, self.task_dirs)
        self.passed = True

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "passed": False}  # another process checks its own machine


class EnvironmentFactory:
    """Zero-argument, picklable callable that builds a fresh harness environment.

    Holds what the spec resolved once: the harness class, the backend and the options. A harness
    loaded from a file (``"path/to/env.py:MyEnv"``) is pickled by its selector and loaded again in
    the worker process that unpickles the factory. ``transforms`` (module-level functions, pickled
    by reference) derive the class actually built, e.g. the harness owning its reward
    (:func:`trl_harbor.training.env.with_environment_reward`) or recording its tool calls.

    Args:
        agent: The harness selector (see :func:`trl_harbor.training.agents.resolve_agent`) or class.
        backend: The resolved backend.
        options: The rollout options.
        harness_kwargs: Further keyword arguments of the harness's constructor.
        cls: The resolved harness class (default: resolved from ``agent``).
        transforms: Functions ``class -> class`` applied, in order, to ``cls``.
        check: The backend check run before the first environment is built (default: none).
    """

    def __init__(
        self,
        agent: str | type[HarborEnv],
        backend: Backend,
        options: HarborOptions,
        harness_kwargs: dict[str, Any] | None = None,
        cls: type[HarborEnv] | None = None,
        transforms: Sequence[Callable[[type], type]] = (),
        check: BackendCheck | None = None,
    ) -> None:
        self.agent = agent
        self.backend = backend
        self.options = options
        self.harness_kwargs = dict(harness_kwargs or {})
        self.cls = cls or resolve_agent(agent)
        self.transforms = tuple(transforms)
        self.check = check or BackendCheck(backend, (), enabled=False)

    @property
    def environment_type(self) -> str:
        """The ``environment_type`` the backend was resolved from."""
        return self.backend.name

    @property
    def built_class(self) -> type[HarborEnv]:
        """The class :meth:`__call__` builds (the harness, transformed)."""
        built = self.cls
        for transform in self.transforms:
            built = transform(built)
        return built

    def __call__(self) -> HarborEnv:
        """Build a new environment.

        Returns:
            A fresh, not yet reset, harness instance.

        Raises:
            trl_harbor.rollout.preflight.BackendUnavailableError: On the first call, when the backend
                cannot start sandboxes here (see :class:`BackendCheck`).
        """
        self.check()
        env = self.built_class(environment_type=self.backend.name, options=self.options, **self.harness_kwargs)
        env._backend = self.backend
        return env

    def transformed(self, transform: Callable[[type], type]) -> EnvironmentFactory:
        """The same factory with one more class transform (e.g. a recording subclass of the harness)."""
        return EnvironmentFactory(
            self.agent,
            self.backend,
            self.options,
            self.harness_kwargs,
            self.cls,
            (*self.transforms, transform),
            self.check,
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if isinstance(self.agent, str) and ":" in self.agent:
            state.pop("cls")  # loaded from a file: loaded again from the selector after unpickling
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if "cls" not in state:
            self.cls = resolve_agent(self.agent)

    def __repr__(self) -> str:
        return f"EnvironmentFactory(agent={self.agent!r}, environment_type={self.backend.name!r})"


class HarborSpec:
    """Wire a Harbor task suite into ``GRPOTrainer``: dataset, environment factory, reward.

    Args:
        dataset: The suite, in any form Harbor's CLI accepts (``docs/datasets.md``): a local
            folder (a ``tasks/`` subtree, or task folders at any depth), a Hugging Face dataset
            repo id (``org/name[@revision]``, or ``hf:org/name``) holding its tasks under
            ``tasks/``, a Harbor registry dataset (``name@version``), a Harbor Hub package
            (``hub:org/name[@ref]``), a git repository at a ref (``repo:org/name@ref``, a git
            URL, ``file://...``), or a run's ``suite.lock.json`` (rerun on exactly its tasks,
            offline from the cache, each checked against its digest).
        agent: The harness: a built-in name (``"bash"``), ``"package.module:ClassName"``,
            ``"path/to/file.py:ClassName"``, or a ``HarborEnv`` subclass; or a loop-owning agent,
            ``"terminus-2"`` (Harbor's Terminus-2, trained through :attr:`rollout_func`; see
            ``docs/agents.md``).
        environment_type: Harbor sandbox backend (``"docker"``, ``"e2b"``, ``"daytona"``,
            ..., ``"local"`` for the bundled bubblewrap sandbox, or ``"module:Class"`` for a
            Harbor plug-in).
        num_tasks: Use only the first ``num_tasks`` tasks of the sorted list (after
            ``task_names`` / ``exclude_task_names``, as Harbor's ``n_tasks``); a fetched dataset
            downloads only those.
        indices: Use exactly these positions of the sorted task list. Exclusive with
            ``num_tasks``.
        include_metadata: Add every task's ``task.toml`` ``[metadata]`` entries as columns.
        revision: Hub revision (branch, tag or commit) when ``dataset`` is a repo id.
        registry_url: The URL of a Harbor registry (a ``registry.json``) for a ``name@version``
            dataset (default: Harbor's registry).
        registry_path: A ``registry.json`` on disk for a ``name@version`` dataset.
        task_names: Keep only the tasks whose name matches one of these globs (Harbor's
            ``--include-task-name``).
        exclude_task_names: Leave out the tasks whose name matches one of these globs.
        download_dir: Where fetched tasks are cached (default: Harbor's, ``~/.cache/harbor/tasks``).
        overwrite: Fetch registry, package and repository tasks again even when cached.
        options: How rollouts run and are graded (:class:`~trl_harbor.HarborOptions`: timeouts,
            output cap, concurrency, infrastructure-failure policy, reward reduction, backend
            options, ...).
        env_kwargs: Keyword arguments of every harness's constructor (for ``"terminus-2"``:
            :class:`~trl_harbor.loop.terminus.TerminusOptions` fields, ``{"max_turns": 20}``). Rollout
            options go in ``options``; a :class:`~trl_harbor.HarborOptions` field here still overrides
            ``options``, with a ``FutureWarning`` (deprecated, :func:`~trl_harbor.options.merge_loose_options`).
        reward_source: Where the trainer gets the verifier's reward: ``"function"`` (default, as in
            ``trl.experimental.harbor``): from :attr:`reward_funcs`, a batch verified at once, and
            a custom reward function passed instead replaces the verifier; ``"environment"``: the
            harness owns it (``get_reward``, :class:`~trl_harbor.training.env.EnvironmentReward`), which
            ``AsyncGRPOTrainer`` needs (its rollout worker reads rewards from its environments);
            :attr:`reward_funcs` is then an empty list.
        preflight: Check that the backend can start sandboxes here (e.g. that Docker's daemon
            answers) when the environment factory or rollout function is first used (the
            trainer's construction), never when the spec is built; ``None``: unless
            ``TRL_HARBOR_PREFLIGHT=0``. See :class:`BackendCheck`.

    Raises:
        ValueError: When both ``num_tasks`` and ``indices`` are given, an index is out of
            range, ``agent`` is an unknown name, ``environment_type`` names no backend, or an
            option is invalid.
        TypeError: When ``agent`` does not resolve to a ``HarborEnv`` subclass, or one of its
            lifecycle hooks cannot be called as the reference calls it
            (:func:`trl_harbor.training.env.check_hooks`).
        trl_harbor.rollout.suite.TaskSuiteError: When the suite cannot be found or fetched (naming the
            dataset, the source and the fix), a cached or locked task differs from its digest, a task is
            malformed, two tasks share a name, or the harness or backend cannot run a task (multi-step tasks without
            a ``submit_step`` tool, compose tasks on the local sandbox, a ``task.toml`` key
            that is a typo); a ``ValueError``.
    """

    def __init__(
        self,
        dataset: str | Path,
        agent: str | type[HarborEnv] = "bash",
        environment_type: str = "docker",
        num_tasks: int | None = None,
        indices: Sequence[int] | None = None,
        include_metadata: bool = True,
        revision: str | None = None,
        *,
        options: HarborOptions | None = None,
        env_kwargs: dict[str, Any] | None = None,
        reward_source: str = "function",
        preflight: bool | None = None,
        registry_url: str | None = None,
        registry_path: str | Path | None = None,
        task_names: Sequence[str] | None = None,
        exclude_task_names: Sequence[str] | None = None,
        download_dir: str | Path | None = None,
        overwrite: bool = False,
    ) -> None:
        if num_tasks is not None and indices is not None:
            raise ValueError("Provide num_tasks or indices, not both.")
        if reward_source not in ("function", "environment"):
            raise ValueError(f"reward_source must be 'function' or 'environment', got {reward_source!r}")
        self.reward_source = reward_source
        self._dataset = dataset
        self._agent = agent
        self._include_metadata = include_metadata
        self.options, harness_kwargs = split_env_kwargs(options, env_kwargs)
        #: The loop-owning agent (``"terminus-2"``), or ``None`` for a harness.
        self.loop_agent: str | None = loop_agent_name(agent)
        self.agent_options: TerminusOptions | None = None
        if self.loop_agent is not None:
            if reward_source != "function":
                raise ValueError(f"agent={agent!r} grades in its rollout_func: reward_source must be 'function'")
            self.agent_options = TerminusOptions.from_kwargs(harness_kwargs)
            harness_kwargs = {}
        #: The harness class (``None`` for a loop-owning agent).
        self.env_cls: type[HarborEnv] | None = None if self.loop_agent else resolve_agent(agent)
        if self.env_cls is not None:
            check_hooks(self.env_cls)
        self.backend = resolve_backend(environment_type, dict(self.options.backend_options))
        #: Where the suite comes from and which of its tasks to keep, as given.
        self.selection = SuiteSelection(
            revision=revision,
            registry_url=registry_url,
            registry_path=registry_path,
            task_names=task_names,
            exclude_task_names=exclude_task_names,
            download_dir=download_dir,
            overwrite=overwrite,
        )
        # A fetched dataset downloads only the first num_tasks; a folder, a Hugging Face snapshot or a
        # lock is validated whole (a malformed task fails the spec), and select_tasks picks among them.
        source = parse_dataset(dataset, revision=revision)
        #: The suite as resolved: its task folders, where each came from, their digests.
        self.resolved = resolve_suite(
            source, self.selection, limit=num_tasks if indices is None and source.fetched else None
        )
        self.suite = load_tasks(self.resolved.task_dirs, source=str(dataset), root=self.resolved.root)
        self._selected: list[tuple[int, TaskInfo]] = select_tasks(
            self.suite.tasks, num_tasks=num_tasks, indices=indices
        )
        if self.resolved.indices is not None:  # a lock: the task_index each task had in the first run
            by_path = {path.resolve(): index for path, index in self.resolved.indices.items()}
            self._selected = [(by_path.get(task.path, i), task) for i, task in self._selected]
        self._lock_options: dict[str, Any] = {
            **self.selection.lock_options(),
            "num_tasks": num_tasks,
            "indices": list(indices) if indices is not None else None,
        }
        if not self._selected:
            raise ValueError(
                f"The selection (num_tasks={num_tasks}, indices={indices}) leaves no task of "
                f"the {len(self.suite.tasks)} in {dataset!s}."
            )
        check_runnable(self.tasks, self.env_cls, self.backend)
        check_task_configs(self.tasks, self.suite.root)
        #: The backend check, run when the factory or rollout function is first used.
        self.backend_check = BackendCheck(self.backend, self.task_dirs, preflight)
        self._factory: EnvironmentFactory | None = None
        self._rollout_func: LoopRolloutFunc | None = None
        if self.agent_options is not None:
            self._rollout_func = LoopRolloutFunc(self.backend, self.options, self.agent_options, self.backend_check)
        else:
            transforms = (with_environment_reward,) if reward_source == "environment" else ()
            self._factory = EnvironmentFactory(
                agent, self.backend, self.options, harness_kwargs, self.env_cls, transforms, self.backend_check
            )

    @property
    def environment_type(self) -> str:
        """The backend's ``environment_type``, as given."""
        return self.backend.name

    @property
    def tasks(self) -> list[TaskInfo]:
        """The selected tasks, in dataset order."""
        return [task for _, task in self._selected]

    @property
    def task_dirs(self) -> list[Path]:
        """Absolute paths of the selected task directories, in dataset order."""
        return [task.path for _, task in self._selected]

    @cached_property
    def lock(self) -> LockedSuite:
        """The pinned record of the selected tasks: names, version, sources, content digests.

        Written into a run's output folder (:meth:`write_lock`); passing that file back as the
        dataset reruns on exactly these tasks (``docs/datasets.md``).
        """
        return self.resolved.lock(self._selected, self._lock_options)

    def write_lock(self, path: str | Path) -> Path:
        """Write :attr:`lock` as a suite lock file.

        Args:
            path: The file, or a folder (``<folder>/suite.lock.json``).

        Returns:
            The file written.
        """
        from trl_harbor.rollout.suite_lock import write_lock

        return write_lock(path, [self.lock])

    @cached_property
    def train_dataset(self) -> Dataset:
        """A ``datasets.Dataset`` with one row per selected task.

        Columns: ``prompt`` (a conversation with an empty user message; ``reset`` supplies
        the instruction), ``task_dir``, ``task_index`` (position in the sorted suite) and,
        with ``include_metadata``, one column per ``[metadata]`` key.
        """
        from datasets import Dataset

        if self.loop_agent is not None:  # the rollout_func gets only the prompts: each carries its task
            prompts = [
                [{"role": "user", "content": task.task.instruction, "task_dir": str(task.path)}]
                for _, task in self._selected
            ]
        else:
            prompts = [[{"role": "user", "content": ""}] for _ in self._selected]
        columns: dict[str, list[Any]] = {
            "prompt": prompts,
            "task_dir": [str(task.path) for _, task in self._selected],
            "task_index": [index for index, _ in self._selected],
        }
        if self._include_metadata:
            columns.update(metadata_columns(self.tasks))
        return Dataset.from_dict(columns)

    @property
    def environment_factory(self) -> EnvironmentFactory | None:
        """A zero-argument, picklable callable returning a fresh harness environment.

        ``None`` for a loop-owning agent, which TRL runs through :attr:`rollout_func` instead.
        """
        return self._factory

    @property
    def rollout_func(self) -> LoopRolloutFunc | None:
        """TRL's ``rollout_func`` of a loop-owning agent (``agent="terminus-2"``), else ``None``.

        Pass it with the other two: ``GRPOTrainer(..., rollout_func=spec.rollout_func,
        environment_factory=spec.environment_factory, reward_funcs=spec.reward_funcs)`` works for
        harnesses and loop agents alike (see :mod:`trl_harbor.loop.rollout_func`).
        """
        return self._rollout_func

    @property
    def reward_funcs(self) -> Callable[..., list[float | None]] | list:
        """The outcome reward (:func:`trl_harbor.training.rewards.harbor_reward`): each rollout's verifier scalar.

        A single function, as in ``trl.experimental.harbor``: pass it as ``reward_funcs=``, or in a
        list with your own (``reward_funcs=[spec.reward_funcs, format_reward]``). With
        ``reward_source="environment"`` the harness owns the reward and this is ``[]`` (TRL then
        needs no reward function).
        """
        if self.loop_agent is not None:
            return loop_reward
        return [] if self.reward_source == "environment" else harbor_reward

    @staticmethod
    def mix(
        specs: Sequence[HarborSpec] | Mapping[str, HarborSpec],
        weights: Sequence[float] | Mapping[str, float] | None = None,
        seed: int = 0,
        *,
        num_rows: int | None = None,
    ) -> HarborMix:
        """Several specs in one training run: rows drawn by weight, each routed to its own environment.

        Args:
            specs: The specs, as a list or a mapping ``{suite name: spec}``.
            weights: One positive weight per spec (``None``: equal weights).
            seed: Seed of the row order.
            num_rows: Rows of the mixed dataset (``None``: enough for every task at these weights).

        Returns:
            A :class:`~trl_harbor.training.mix.HarborMix` (``docs/mixing.md``), which says what each argument
            may be and what it raises.
        """
        from trl_harbor.training.mix import HarborMix

        return HarborMix(specs, weights, seed, num_rows=num_rows)

    def __repr__(self) -> str:
        return (
            f"HarborSpec(dataset={str(self._dataset)!r}, agent={self._agent!r}, "
            f"environment_type={self.backend.name!r}, tasks={len(self._selected)})"
        )
