"""Train an agent with GRPO on a Harbor task suite (default: the bundled suite, local sandbox).

The same job as ``trl-harbor train``, written out in Python. CPU run (a few minutes, no
download, no Docker): with ``--model tiny`` (the default) the policy is the *demo policy* of
``trl_harbor.demo_policy`` — a tiny trainable network, not a language model, that calls ``bash``
with one of four candidate commands per task (the reference solution or one of three wrong
ones); the sandboxes and Harbor's verifiers are real, and GRPO raises the mean reward::

    python examples/train_grpo.py

A real run on a GPU::

    python examples/train_grpo.py --model Qwen/Qwen3-0.6B --use-vllm \\
        --num-generations 8 --max-steps 50 --max-completion-length 2048 \\
        --max-tool-calling-iterations 10 --environment-type local

Any Harbor backend works (``--environment-type docker``, ``e2b``, ``daytona``, ... or a
``module:Class`` plug-in), as does any harness (``--agent path/to/env.py:MyEnv``).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).

    Returns:
        The parsed options.
    """
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", default=str(REPO / "examples" / "tasks"), help="local path or HF dataset repo id")
    parser.add_argument("--agent", default="bash", help="harness: 'bash', 'pkg.mod:Cls' or 'file.py:Cls'")
    parser.add_argument("--environment-type", default="local", help="Harbor backend (local, docker, e2b, ...)")
    parser.add_argument("--num-tasks", type=int, default=None)
    parser.add_argument("--model", default="tiny", help="'tiny' (built on the fly, CPU) or a model id/path")
    parser.add_argument("--use-vllm", action="store_true", help="generate with vLLM (colocate mode, GPU)")
    parser.add_argument("--cpu", action="store_true", help="force CPU (default for --model tiny)")
    parser.add_argument("--max-steps", type=int, default=-1, help="-1: one pass over the suite")
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=None, help="per-device batch (default: num generations)")
    parser.add_argument("--max-completion-length", type=int, default=128)
    parser.add_argument("--max-tool-calling-iterations", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=None, help="default: 0.01 (SGD) tiny, 1e-5 (AdamW) real")
    parser.add_argument("--command-timeout", type=int, default=180, help="seconds per tool command")
    parser.add_argument("--log-completions", action="store_true", help="print each step's rollouts")
    parser.add_argument("--output-dir", default="outputs/grpo-harbor")
    parser.add_argument("--seed", type=int, default=1)
    return parser.parse_args(argv)


def tiny_policy(spec):
    """Build the demo policy (a tiny CPU network choosing among right and wrong commands per task).

    Args:
        spec: The ``HarborSpec`` (its tasks, instructions and harness prompt).

    Returns:
        ``(model, tokenizer)``.
    """
    from trl_harbor.demo_policy import build_demo_policy

    instructions = [Path(d, "instruction.md").read_text() for d in spec.task_dirs]
    policy = build_demo_policy(spec.tasks, instructions, spec.env_cls.PROMPT_SUFFIX)
    return policy.model, policy.tokenizer


def main(argv: list[str] | None = None) -> None:
    """Build the spec and the trainer, train, and stop every sandbox.

    Args:
        argv: Command-line arguments (default: ``sys.argv[1:]``).
    """
    args = parse_args(argv)
    os.environ.setdefault("HARBOR_TELEMETRY", "0")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from trl import GRPOConfig, GRPOTrainer

    from trl_harbor import HarborSpec, close_all

    spec = HarborSpec(
        args.suite,
        agent=args.agent,
        environment_type=args.environment_type,
        num_tasks=args.num_tasks,
        env_kwargs={"command_timeout_sec": args.command_timeout},
    )
    tiny = args.model == "tiny"
    if tiny:
        model, tokenizer = tiny_policy(spec)
    else:
        model, tokenizer = args.model, None
    config = GRPOConfig(
        output_dir=args.output_dir,
        use_cpu=tiny or args.cpu,
        bf16=not (tiny or args.cpu),
        use_vllm=args.use_vllm,
        vllm_mode="colocate",
        max_steps=args.max_steps,
        num_generations=args.num_generations,
        per_device_train_batch_size=args.batch_size or args.num_generations,
        max_completion_length=args.max_completion_length,
        max_tool_calling_iterations=args.max_tool_calling_iterations,
        learning_rate=args.learning_rate or (0.01 if tiny else 1e-5),
        optim="sgd" if tiny else "adamw_torch",
        logging_steps=1,
        log_completions=args.log_completions,
        num_train_epochs=1,
        report_to="none",
        save_strategy="no",
        seed=args.seed,
    )
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        args=config,
        train_dataset=spec.train_dataset,
        environment_factory=spec.environment_factory,
        reward_funcs=spec.reward_funcs,
    )
    try:
        trainer.train()
    finally:
        close_all()
    for record in trainer.state.log_history:
        if "reward" in record:
            print(
                f"step {record.get('step', '?')}: reward={record['reward']} tool calls/rollout="
                f"{record.get('tools/call_frequency')}"
            )


if __name__ == "__main__":
    main()
