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
at once; the three properties are computed on first access (``datasets`` is imported only by
``train_dataset``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trl_harbor.agents import resolve_agent
from trl_harbor.env import HarborEnv, verify_all
from trl_harbor.preflight import (
    DEFAULT_INFRA_STOP_FRACTION,
    check_backend,
    check_batch,
    check_task_configs,
    preflight_enabled,
)
from trl_harbor.sandboxes import LOCAL_ENVIRONMENT_IMPORT_PATH
from trl_harbor.suite import TaskInfo, TaskSuiteError, load_suite, metadata_columns, select_tasks

if TYPE_CHECKING:
    from datasets import Dataset

    from trl_harbor.mix import HarborMix

__all__ = ["EnvironmentFactory", "HarborSpec", "check_runnable", "harbor_reward"]


def harbor_reward(
    completions: Sequence[Any] | None = None,
    environments: Sequence[HarborEnv] | None = None,
    environment_reward: Sequence[float | None] | None = None,
    log_metric: Callable[[str, float], None] | None = None,
    log_extra: Callable[[str, list], None] | None = None,
    infra_stop_fraction: float | None = DEFAULT_INFRA_STOP_FRACTION,
    **kwargs: Any,
) -> list[float | None]:
    """Outcome reward: the Harbor verifier's scalar for each rollout, verified concurrently.

    ``GRPOTrainer`` passes the live environments (``environments=``, in completion order):
    every rollout of the batch is verified at once (:func:`trl_harbor.env.verify_all`);
    environments that are not ``HarborEnv`` are read through their public ``reward``.
    Trainers that run environments elsewhere pass the already computed scores as
    ``environment_reward=``. A rollout lost to an infrastructure failure scores ``None``
    (left out of the batch by TRL) or ``0.0``, per the environment's ``on_infra_error``; a
    rollout that broke its own verification scores ``0.0``. Logged per batch: the metrics
    ``harbor/infra_failures``, ``harbor/verifier_failures``, ``harbor/tampered`` and the mean
    of every reward component (``harbor/reward/<key>``), and each rollout's reason in the
    ``harbor_error`` column of the completions table.

    Args:
        completions: The completions (unused; part of TRL's reward-function signature).
        environments: The rollouts' environments.
        environment_reward: Per-rollout rewards computed elsewhere; used as given.
        log_metric: TRL's metric logger (passed by ``GRPOTrainer``).
        log_extra: TRL's completions-table logger (passed by ``GRPOTrainer``).
        infra_stop_fraction: Stop the run when at least this fraction of the batch was lost
            to the infrastructure (default: all of it); ``None`` never stops
            (:func:`trl_harbor.preflight.check_batch`).
        **kwargs: Other columns TRL passes (ignored).

    Returns:
        One reward per rollout.

    Raises:
        ValueError: When neither ``environments`` nor ``environment_reward`` is given.
        trl_harbor.preflight.InfrastructureFailureError: When the batch was lost to the
            infrastructure (after its metrics are logged).
    """
    if environment_reward is not None:
        return [None if r is None else float(r) for r in environment_reward]
    if environments is None:
        raise ValueError(
            "harbor_reward needs `environments=` (GRPOTrainer with environment_factory) or "
            "`environment_reward=`; got neither."
        )
    harbor_envs = [env for env in environments if isinstance(env, HarborEnv)]
    verified = iter(verify_all(harbor_envs))
    # Any other environment (e.g. one written for the reference) is read through its public `reward`.
    rewards = [next(verified) if isinstance(env, HarborEnv) else _as_reward(env.reward) for env in environments]
    outcomes = [env.verification if isinstance(env, HarborEnv) else None for env in environments]
    if log_metric is not None:
        log_metric("harbor/infra_failures", float(sum(bool(o and o.infra) for o in outcomes)))
        log_metric("harbor/verifier_failures", float(sum(bool(o and o.reason and not o.infra) for o in outcomes)))
        log_metric("harbor/tampered", float(sum(bool(o and o.tampered) for o in outcomes)))
        components: dict[str, list[float]] = {}
        for outcome in outcomes:
            for key, value in (outcome.rewards if outcome else {}).items():
                components.setdefault(key, []).append(value)
            for step, step_rewards in outcome.steps if outcome else ():
                for key, value in step_rewards.items():
                    components.setdefault(f"{step}/{key}", []).append(value)
        for key, values in sorted(components.items()):
            log_metric(f"harbor/reward/{key}", sum(values) / len(values))
    if log_extra is not None:
        log_extra("harbor_error", [(o.reason if o else "") for o in outcomes])
    check_batch(outcomes, infra_stop_fraction)
    return rewards


def _as_reward(value: Any) -> float | None:
    return None if value is None else float(value)


def check_runnable(tasks: Sequence[TaskInfo], env_cls: type[HarborEnv], environment_type: str) -> None:
    """Refuse, when the spec is built, tasks that the harness or the backend cannot run.

    Args:
        tasks: The selected tasks.
        env_cls: The harness.
        environment_type: The backend.

    Raises:
        TaskSuiteError: Naming every such task, why, and the fix.
    """
    problems = []
    if not callable(getattr(env_cls, "submit_step", None)):
        for task in tasks:
            if task.steps:
                problems.append(
                    f"{task.path}/task.toml: [[steps]] ({task.steps} steps) needs a harness with a "
                    f"`submit_step` tool, and {env_cls.__name__} has none. Fix: agent='bash_steps', or "
                    "add trl_harbor.StepsMixin to your harness."
                )
    if environment_type in ("local", LOCAL_ENVIRONMENT_IMPORT_PATH):
        for task in tasks:
            if task.compose:
                problems.append(
                    f"{task.path}/environment/docker-compose.yaml: the local sandbox runs one container, "
                    "not compose services (the sidecars would be silently missing). Fix: "
                    "environment_type='docker' (or another backend that runs compose), or leave the task out."
                )
    if problems:
        raise TaskSuiteError(f"{len(problems)} task(s) cannot run here:\n" + "\n".join(f"  - {p}" for p in problems))


class EnvironmentFactory:
    """Zero-argument, picklable callable that builds a fresh harness environment.

    The harness is kept as the user's selector (e.g. a file path string) and resolved again
    after unpickling, so the factory also works in worker processes that never built the spec.

    Args:
        agent: The harness selector (see :func:`trl_harbor.agents.resolve_agent`).
        environment_type: Harbor backend passed to every environment.
        env_kwargs: Extra keyword arguments for the environment's constructor.
    """

    def __init__(
        self,
        agent: str | type[HarborEnv],
        environment_type: str,
        env_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.agent = agent
        self.environment_type = environment_type
        self.env_kwargs = dict(env_kwargs or {})
        self._cls = resolve_agent(agent)

    def __call__(self) -> HarborEnv:
        """Build a new environment.

        Returns:
            A fresh, not yet reset, harness instance.
        """
        return self._cls(environment_type=self.environment_type, **self.env_kwargs)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if isinstance(self.agent, str):
            state.pop("_cls")  # re-resolved from the selector after unpickling
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if "_cls" not in state:
            self._cls = resolve_agent(self.agent)

    def __repr__(self) -> str:
        return f"EnvironmentFactory(agent={self.agent!r}, environment_type={self.environment_type!r})"


class HarborSpec:
    """Wire a Harbor task suite into ``GRPOTrainer``: dataset, environment factory, reward.

    Args:
        dataset: A Hugging Face dataset repo id holding a Harbor task tree under ``tasks/``,
            or a local path holding a ``tasks/`` subtree (a path whose children are task
            dirs is accepted too).
        agent: The harness: a built-in name (``"bash"``), ``"package.module:ClassName"``,
            ``"path/to/file.py:ClassName"``, or a ``HarborEnv`` subclass.
        environment_type: Harbor sandbox backend (``"docker"``, ``"e2b"``, ``"daytona"``,
            ..., ``"local"`` for the bundled bubblewrap sandbox, or ``"module:Class"`` for a
            Harbor plug-in). Passed through, not validated here.
        num_tasks: Use only the first ``num_tasks`` tasks of the sorted list.
        indices: Use exactly these positions of the sorted task list. Exclusive with
            ``num_tasks``.
        include_metadata: Add every task's ``task.toml`` ``[metadata]`` entries as columns.
        revision: Hub revision (branch, tag or commit) when ``dataset`` is a repo id.
        env_kwargs: Extra keyword arguments for every environment (e.g.
            ``{"command_timeout_sec": 60, "max_output_chars": 4000}``).
        preflight: Check now that the backend can start sandboxes here (e.g. that Docker's
            daemon answers); ``None``: unless ``TRL_HARBOR_PREFLIGHT=0``. See
            :mod:`trl_harbor.preflight`.
        infra_stop_fraction: ``reward_funcs`` stops the run when at least this fraction of a
            batch was lost to the infrastructure (default: all of it); ``None`` never stops.

    Raises:
        ValueError: When both ``num_tasks`` and ``indices`` are given, an index is out of
            range, or ``agent`` is an unknown name.
        TypeError: When ``agent`` does not resolve to a ``HarborEnv`` subclass.
        trl_harbor.suite.TaskSuiteError: When the suite cannot be found, a task is
            malformed, or the harness or backend cannot run a task (multi-step tasks without
            a ``submit_step`` tool, compose tasks on the local sandbox, a ``task.toml`` key
            that is a typo); a ``ValueError``.
        trl_harbor.preflight.BackendUnavailableError: When the preflight finds that the
            backend cannot start sandboxes here.
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
        env_kwargs: dict[str, Any] | None = None,
        preflight: bool | None = None,
        infra_stop_fraction: float | None = DEFAULT_INFRA_STOP_FRACTION,
    ) -> None:
        if num_tasks is not None and indices is not None:
            raise ValueError("Provide num_tasks or indices, not both.")
        self._dataset = dataset
        self._agent = agent
        self._environment_type = environment_type
        self._include_metadata = include_metadata
        self._env_kwargs = dict(env_kwargs or {})
        self.env_cls: type[HarborEnv] = resolve_agent(agent)
        self.suite = load_suite(dataset, revision=revision)
        self._selected: list[tuple[int, TaskInfo]] = select_tasks(
            self.suite.tasks, num_tasks=num_tasks, indices=indices
        )
        if not self._selected:
            raise ValueError(
                f"The selection (num_tasks={num_tasks}, indices={indices}) leaves no task of "
                f"the {len(self.suite.tasks)} in {dataset!s}."
            )
        check_runnable(self.tasks, self.env_cls, environment_type)
        check_task_configs(self.task_dirs, self.suite.root)
        self._infra_stop_fraction = infra_stop_fraction
        if preflight_enabled(preflight):
            check_backend(environment_type, self._env_kwargs.get("environment_kwargs"), self.task_dirs)

    @property
    def tasks(self) -> list[TaskInfo]:
        """The selected tasks, in dataset order."""
        return [task for _, task in self._selected]

    @property
    def task_dirs(self) -> list[Path]:
        """Absolute paths of the selected task directories, in dataset order."""
        return [task.path for _, task in self._selected]

    @cached_property
    def train_dataset(self) -> Dataset:
        """A ``datasets.Dataset`` with one row per selected task.

        Columns: ``prompt`` (a conversation with an empty user message; ``reset`` supplies
        the instruction), ``task_dir``, ``task_index`` (position in the sorted suite) and,
        with ``include_metadata``, one column per ``[metadata]`` key.
        """
        from datasets import Dataset

        columns: dict[str, list[Any]] = {
            "prompt": [[{"role": "user", "content": ""}] for _ in self._selected],
            "task_dir": [str(task.path) for _, task in self._selected],
            "task_index": [index for index, _ in self._selected],
        }
        if self._include_metadata:
            columns.update(metadata_columns(self.tasks))
        return Dataset.from_dict(columns)

    @cached_property
    def environment_factory(self) -> Callable[[], HarborEnv]:
        """A zero-argument, picklable callable returning a fresh harness environment."""
        return EnvironmentFactory(self._agent, self._environment_type, self._env_kwargs)

    @property
    def reward_funcs(self) -> list[Callable[..., list[float]]]:
        """The outcome reward as a one-element list: each rollout's verifier scalar."""
        if self._infra_stop_fraction == DEFAULT_INFRA_STOP_FRACTION:
            return [harbor_reward]
        reward = functools.partial(harbor_reward, infra_stop_fraction=self._infra_stop_fraction)
        reward.__name__ = harbor_reward.__name__  # type: ignore[attr-defined] - TRL names reward columns by it
        return [reward]

    @staticmethod
    def mix(
        specs: Sequence[HarborSpec] | Mapping[str, HarborSpec],
        weights: Sequence[float] | Mapping[str, float] | None = None,
        seed: int = 0,
        *,
        num_rows: int | None = None,
    ) -> HarborMix:
        """Mix several specs (suites, harnesses, backends) into one training run.

        See :class:`trl_harbor.mix.HarborMix` and ``docs/mixing.md``.

        Args:
            specs: The specs, as a list or a mapping ``{suite name: spec}``.
            weights: One positive weight per spec (need not sum to 1); ``None``: equal.
            seed: Seed of the mixed dataset's row order.
            num_rows: Rows of the mixed dataset; ``None``: every task at least once.

        Returns:
            A :class:`~trl_harbor.mix.HarborMix` with ``train_dataset``,
            ``environment_factory`` (a dict) and ``reward_funcs``.

        Raises:
            TypeError: When a spec is not a ``HarborSpec``.
            trl_harbor.mix.HarborMixError: When the combination is impossible (a ``ValueError``).
        """
        from trl_harbor.mix import HarborMix

        return HarborMix(specs, weights, seed, num_rows=num_rows)

    def __repr__(self) -> str:
        return (
            f"HarborSpec(dataset={str(self._dataset)!r}, agent={self._agent!r}, "
            f"environment_type={self._environment_type!r}, tasks={len(self._selected)})"
        )
