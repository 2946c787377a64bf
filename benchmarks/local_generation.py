"""A local model's sampling (``trl-harbor eval`` without an endpoint, the default run's held-out
measure): the prompts' shared beginning run once, against every row running it.

Every rollout's prompt starts with the same system prompt, tool schema and example turns (the
default run's: ~600 tokens) and ends with its own task. The default run's model samples its first
turn on the held-out tasks (7 tasks × ``--rollouts``, batches of 16, greedy so both ways can be
compared token for token) twice in one process: the baseline runs each prompt whole (left-padded),
then :class:`~trl_harbor.cli.evaluate.LocalPolicy` as it is (the shared part once, its cache copied
per row). Prints seconds, the tokens the model ran, the ratio, and whether the completions match::

    .venv/bin/python benchmarks/local_generation.py [--rollouts 4] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    from trl_harbor.cli.evaluate import EvalConfig, LocalPolicy
    from trl_harbor.cli.prompting import load_few_shot, openai_messages, prompt_prefix
    from trl_harbor.cli.starter_model import ensure_starter_model
    from trl_harbor.cli.train import DEFAULT_RUN, DEFAULT_SYSTEM_PROMPT
    from trl_harbor.training.harnesses.bash_minimal import MinimalBashEnv
    from trl_harbor.training.shared_prefix import shared_prefix
    from trl_harbor.training.tools import tool_schemas

    policy = LocalPolicy.from_pretrained(str(ensure_starter_model()), chat_template=DEFAULT_RUN["chat_template"])
    _, tools = tool_schemas(MinimalBashEnv())
    head = openai_messages(prompt_prefix(DEFAULT_SYSTEM_PROMPT, load_few_shot(DEFAULT_RUN["few_shot"])))
    tasks = sorted((ROOT / "examples" / "starter_tasks" / "heldout").iterdir())
    asks = [(t / "instruction.md").read_text() for t in tasks if t.is_dir()] * args.rollouts
    prompts = [policy._prompt_ids([*head, {"role": "user", "content": a}], tools) for a in asks]
    config = EvalConfig(dataset=".", base_url=None, model="starter", temperature=0.0, max_tokens=args.max_tokens)
    size = config.batch_size

    run: list[int] = []
    policy.model.register_forward_pre_hook(lambda _m, a, kw: run.append(kw["input_ids"].numel()), with_kwargs=True)
    policy.model.eval()
    results = {}
    for name in ("whole prompts", "shared part once"):
        run.clear()
        started = time.perf_counter()
        prefix = shared_prefix(policy.model, prompts) if name == "shared part once" else None
        out = [
            ids for s in range(0, len(prompts), size) for ids in policy._generate(prompts[s : s + size], config, prefix)
        ]
        results[name] = (time.perf_counter() - started, sum(run), out)
    base_s, base_tokens, base_out = results["whole prompts"]
    shared = len(prefix.ids) if prefix else 0
    print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, {shared} shared; "
          f"batches of {size}, up to {args.max_tokens} new tokens")  # fmt: skip
    print(f"{'':<18} {'seconds':>8} {'tokens run':>11} {'time / baseline':>16} {'same completions':>17}")
    for name, (seconds, tokens, out) in results.items():
        print(f"{name:<18} {seconds:>8.1f} {tokens:>11} {seconds / base_s:>16.2f} {str(out == base_out):>17}")


if __name__ == "__main__":
    main()
