"""``trl-harbor train``: GRPO on a Harbor task suite from the command line.

Every ``trl.GRPOConfig`` field is a flag, and a ``--config file.yaml`` sets any of them (and the
Harbor options of :class:`HarborTrainArguments`) with TRL's own parser conventions
(``trl.TrlParser``): the file replaces the defaults, flags on the command line override the
file, an ``env:`` mapping in the file sets environment variables. Flags take ``--num_generations``
or ``--num-generations``.

With no ``--model`` it runs the **embedded default**: the bundled suite (``examples/tasks``), the
local sandbox, and a tiny *demo policy* on CPU (:mod:`trl_harbor.demo_policy`: a one-layer
network that chooses among right and wrong ``bash`` commands per task, not a language model),
for a few minutes, so that one sees GRPO raise the mean reward from real verifiers in real
sandboxes. With ``--model`` (a hub id or a path) it trains that model.

Every rollout is written to ``<output_dir>/trajectories.jsonl``
(:class:`trl_harbor.trajectories.TrajectoryLog`), the per-step metrics to
``<output_dir>/log_history.json`` and the summary to ``<output_dir>/summary.json``.
"""

from __future__ import annotations

import json
import logging
import os
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

__all__ = [
    "DEMO_DEFAULTS",
    "HarborTrainArguments",
    "TrainSetupError",
    "TrainSummary",
    "bundled_suite",
    "main",
    "parse_train_args",
    "quiet_libraries",
    "run_train",
]

logger = logging.getLogger(__name__)

#: ``GRPOConfig`` defaults of the embedded default run (a file or flags still override them).
DEMO_DEFAULTS: dict[str, Any] = {
    "output_dir": "outputs/trl-harbor-demo",
    "use_cpu": True,
    "bf16": False,
    "max_steps": 10,
    "num_generations": 4,
    "per_device_train_batch_size": 32,  # 8 tasks x 4 rollouts per step: every task early, smooth means
    # Plain SGD: Adam's sign-like steps move every weight by ~lr whatever its gradient, which
    # detunes the demo policy's hand-set weights until it stops calling tools (measured).
    "optim": "sgd",
    "learning_rate": 0.01,
    "max_completion_length": 128,
    "max_tool_calling_iterations": 1,
    "logging_steps": 1,
    "report_to": "none",
    "save_strategy": "no",
    "seed": 0,
}

#: What the demo prints about itself, and how to train for real.
DEMO_BANNER = (
    "trl-harbor train — embedded default run (no --model given)\n"
    "  suite   {suite} ({tasks} tasks), harness {agent}, sandbox backend {environment_type}\n"
    "  policy  a DEMO POLICY, not a language model: a one-layer network on CPU that calls the bash tool\n"
    "          with one of 4 commands per task (the task's reference solution, or one of 3 wrong ones,\n"
    "          equally likely at first). The sandboxes and Harbor's verifiers are real; GRPO must learn\n"
    "          from their rewards which command each task rewards, so the mean reward should rise.\n"
    "  train for real (GPU):  trl-harbor train --model Qwen/Qwen3-0.6B --environment_type local \\\n"
    "          --num_generations 8 --max_steps 50 --max_tool_calling_iterations 10 --bf16 --use_vllm"
)


def bundled_suite() -> Path:
    """The bundled 15-task suite (``examples/tasks`` of a source checkout).

    Returns:
        Its path.

    Raises:
        FileNotFoundError: When trl-harbor is installed without its examples (pass ``--dataset``).
    """
    path = Path(__file__).resolve().parents[2] / "examples" / "tasks"
    if not path.is_dir():
        raise FileNotFoundError(
            f"the bundled suite is not at {path} (trl-harbor installed without its examples); "
            "pass --dataset PATH_OR_HUB_ID"
        )
    return path


class TrainSetupError(ValueError):
    """The run cannot start: a bad suite, harness or task selection, or a suite the demo cannot play."""


@dataclass
class HarborTrainArguments:
    """The Harbor side of ``trl-harbor train`` (the trainer's side is ``trl.GRPOConfig``).

    Attributes:
        model: Model to train: a hub id or a local path. ``None``: the embedded default run
            with the demo policy (:mod:`trl_harbor.demo_policy`).
        dataset: The task suite(s): local folders or Hugging Face dataset ids (``None``: the
            bundled suite). Several suites are mixed in one run (:meth:`HarborSpec.mix`).
        dataset_weights: With several suites, how often each one's rows come (default: equal;
            they need not sum to 1).
        agent: The harness: ``bash``, ``jupyter``, ``terminal_notes``, ``pkg.mod:Class`` or
            ``path/to/file.py:Class``; or ``terminus-2`` (Harbor's Terminus-2, a loop-owning agent:
            its turns are ``--max_tool_calling_iterations``, its token budget ``--max_completion_length``).
        environment_type: Harbor sandbox backend: ``local``, ``docker``, ``e2b``, ...,
            or ``module:Class``.
        ek: Backend options as ``key=value`` (``--ek root=host``: the local sandbox on the host root).
        num_tasks: Use the first N tasks of the sorted suite.
        indices: Use exactly these positions of the sorted suite (exclusive with ``num_tasks``).
        revision: Hub revision of ``dataset``.
        command_timeout_sec: Seconds one tool command may run.
        max_output_chars: Characters of a command's output handed back to the model.
        reward_key: Which key of a multi-key ``reward.json`` is the reward.
        on_infra_error: ``skip``, ``zero`` or ``raise`` for a rollout lost to infrastructure.
        max_concurrent_starts: Sandboxes started at once (cloud quotas).
        trajectories: Write ``trajectories.jsonl`` (one line per rollout) into ``output_dir``.
    """

    model: str | None = field(default=None, metadata={"help": "hub id or path; none: the embedded demo run"})
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
        default_factory=list, metadata={"help": "backend options key=value, e.g. --ek root=host (several: a=1 b=2)"}
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
        demo: Whether this was the embedded default run.
    """

    steps: int
    rewards: list[float | None]
    first_reward: float | None
    last_reward: float | None
    rollouts: int
    seconds: float
    output_dir: str
    demo: bool


def _parser(demo: bool):
    import torch
    from trl import GRPOConfig, TrlParser

    parser = TrlParser((HarborTrainArguments, GRPOConfig), prog="trl-harbor train")
    if demo:
        parser.set_defaults(**DEMO_DEFAULTS)
    elif not torch.cuda.is_available():
        parser.set_defaults(use_cpu=True, bf16=False)  # no GPU: train on CPU unless told otherwise
    return parser


def parse_train_args(argv: Sequence[str]) -> tuple[HarborTrainArguments, GRPOConfig]:
    """Parse ``trl-harbor train``'s arguments: defaults < ``--config`` YAML < flags.

    Without a model (neither ``--model`` nor ``model:`` in the file), the defaults are those
    of the embedded run (:data:`DEMO_DEFAULTS`); without a GPU, ``use_cpu=True`` and
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
        _parser(demo=False).parse_args_and_config(argv)  # prints the help and exits
    # First pass, Harbor options only: is there a model? (a fresh parser: the file sets its defaults)
    harbor, _ = TrlParser(HarborTrainArguments).parse_args_and_config(argv, return_remaining_strings=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _parser(demo=harbor.model is None).parse_args_and_config(argv)


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
            self.start = time.monotonic()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "reward" not in logs:
                return
            parts = [f"step {state.global_step:>3}/{total_steps}", f"mean reward {logs['reward']:.3f}"]
            if "reward_std" in logs:
                parts.append(f"± {logs['reward_std']:.3f}")
            if "tools/call_frequency" in logs:
                parts.append(f"tool calls/rollout {logs['tools/call_frequency']:.2f}")
            failures = logs.get("harbor/infra_failures")
            if failures:
                parts.append(f"infra failures {failures:g}")
            parts.append(f"{time.monotonic() - self.start:.0f} s")
            print_fn("  ".join(parts), flush=True)

    return StepPrinter()


def _build_demo(spec, seed: int):
    from trl_harbor.demo_policy import build_demo_policy

    instructions = [Path(d, "instruction.md").read_text(encoding="utf-8") for d in spec.task_dirs]
    return build_demo_policy(spec.tasks, instructions, spec.env_cls.PROMPT_SUFFIX, seed=seed)


def run_train(harbor: HarborTrainArguments, config: GRPOConfig, print_fn=print) -> TrainSummary:
    """Build the spec, the trainer and the trajectory log; train; stop every sandbox.

    Args:
        harbor: The Harbor options (``model=None``: the embedded demo run).
        config: The trainer's configuration.
        print_fn: Where the progress lines and the summary go.

    Returns:
        The run's summary (also written to ``<output_dir>/summary.json``).

    Raises:
        TrainSetupError: For a bad suite, harness or selection (from :class:`~trl_harbor.HarborSpec`),
            or a suite the demo policy cannot play.
    """
    import torch
    from transformers import PrinterCallback, ProgressCallback
    from trl import GRPOTrainer

    from trl_harbor import HarborSpec, close_all
    from trl_harbor.backends import parse_backend_options
    from trl_harbor.preflight import BackendUnavailableError
    from trl_harbor.trajectories import TrajectoryLog

    demo = harbor.model is None
    try:
        suites = harbor.dataset if harbor.dataset else [str(bundled_suite())]
    except FileNotFoundError as exc:
        raise TrainSetupError(str(exc)) from exc
    dataset = ", ".join(suites)
    try:
        specs = [
            HarborSpec(
                suite,
                agent=harbor.agent,
                environment_type=harbor.environment_type,
                num_tasks=harbor.num_tasks,
                indices=harbor.indices,
                revision=harbor.revision,
                env_kwargs={
                    "command_timeout_sec": harbor.command_timeout_sec,
                    "max_output_chars": harbor.max_output_chars,
                    "reward_key": harbor.reward_key,
                    "on_infra_error": harbor.on_infra_error,
                    "max_concurrent_starts": harbor.max_concurrent_starts,
                    "backend_options": parse_backend_options(harbor.ek),
                },
            )
            for suite in suites
        ]
        if len(specs) > 1 and demo:
            raise TrainSetupError("the demo run plays one suite; pass --model to train on several --dataset")
        if demo and specs[0].loop_agent is not None:
            raise TrainSetupError(f"the demo policy plays the bash harness, not {harbor.agent}; pass --model")
        spec = specs[0] if len(specs) == 1 else HarborSpec.mix(specs, harbor.dataset_weights, seed=config.seed)
        policy = _build_demo(spec, seed=config.seed) if demo else None
    except (ValueError, TypeError, FileNotFoundError, BackendUnavailableError) as exc:
        raise TrainSetupError(str(exc)) from exc
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if demo:
        print_fn(
            DEMO_BANNER.format(
                suite=dataset,
                tasks=len(spec.tasks),
                agent=harbor.agent,
                environment_type=harbor.environment_type,
            )
        )
        model, tokenizer = policy.model, policy.tokenizer
    else:
        print_fn(f"trl-harbor train: {harbor.model} on {dataset} ({len(spec.tasks)} tasks), harness {harbor.agent}, "
                 f"backend {harbor.environment_type}")  # fmt: skip
        model, tokenizer = harbor.model, None
    environment_factory = spec.environment_factory
    rollout_func = getattr(spec, "rollout_func", None)  # a loop-owning agent (terminus-2) runs as TRL's rollout_func
    reward_funcs = spec.reward_funcs
    log = None
    if harbor.trajectories:
        log = TrajectoryLog(output_dir / "trajectories.jsonl", environment_type=harbor.environment_type)
        log.path.unlink(missing_ok=True)  # one run, one log
        if environment_factory is not None:
            environment_factory = log.environment_factory(environment_factory)
        reward_funcs = log.reward_func(reward_funcs)
    torch.manual_seed(config.seed)
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        args=config,
        train_dataset=spec.train_dataset,
        environment_factory=environment_factory,
        rollout_func=rollout_func,
        reward_funcs=reward_funcs,
    )
    total = trainer.args.max_steps if trainer.args.max_steps > 0 else None
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(_progress_callback(total or 0, print_fn))
    print_fn(f"training: {total or 'one epoch of'} steps, {config.num_generations} rollouts per task, "
             f"logs in {output_dir}")  # fmt: skip
    start = time.monotonic()
    # Inside a step: sandbox starts and verification, as a line that is redrawn on a terminal.
    previous = progress.set_reporter(progress.LineReporter(sys.stderr.write, sys.stderr.isatty()))
    try:
        trainer.train()
    finally:
        progress.set_reporter(previous)
        close_all()
        if rollout_func is not None:
            rollout_func.close()  # the capture endpoint
    seconds = time.monotonic() - start
    trainer.save_model(str(output_dir))  # `trl-harbor eval --model OUTPUT_DIR` evaluates it
    history = trainer.state.log_history
    rewards = [record.get("reward") for record in history if "reward" in record]
    summary = TrainSummary(
        steps=int(trainer.state.global_step),
        rewards=rewards,
        first_reward=rewards[0] if rewards else None,
        last_reward=rewards[-1] if rewards else None,
        rollouts=log.written if log is not None else 0,
        seconds=round(seconds, 1),
        output_dir=str(output_dir),
        demo=demo,
    )
    if trainer.is_world_process_zero():  # one writer in a multi-process run
        (output_dir / "log_history.json").write_text(json.dumps(history, indent=1, default=str))
        (output_dir / "summary.json").write_text(json.dumps(summary.__dict__, indent=1))
        print_fn(_summary_text(summary, log))
    return summary


def _summary_text(summary: TrainSummary, log) -> str:
    lines = [f"done: {summary.steps} steps in {summary.seconds:.0f} s, {summary.rollouts} rollouts"]
    if summary.first_reward is not None and summary.last_reward is not None:
        change = summary.last_reward - summary.first_reward
        verdict = "rose" if change > 0 else "did not rise"
        lines.append(
            f"mean reward: first step {summary.first_reward:.3f} → last step {summary.last_reward:.3f} "
            f"({verdict}, {change:+.3f})"
        )
    if log is not None:
        lines.append(f"trajectories: {log.path}")
    lines.append(f"metrics: {Path(summary.output_dir, 'log_history.json')}")
    if summary.demo:
        lines.append("This was the demo policy. Train a real model with --model (e.g. Qwen/Qwen3-0.6B, on a GPU).")
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
