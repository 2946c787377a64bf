"""A real ``GRPOTrainer`` step on CPU with ``HarborSpec`` and the local sandbox.

The policy is a tiny ``Qwen3ForCausalLM`` built on the fly, rigged (see
``trl_harbor.testing.script_tool_calls``) to answer every prompt with one of two ``bash`` tool
calls — one writes the gold answer, one a wrong answer — so tools really run in sandboxes and
the verifier's rewards differ within the group.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import BUNDLED_SUITE, GOLD_ANSWER, GOLD_TASK, requires_local

GOOD_COMMAND = f"echo -n {GOLD_ANSWER} > /workdir/answer.txt"
BAD_COMMAND = "echo -n 0 > /workdir/answer.txt"


@requires_local
@pytest.mark.slow
def test_grpo_step_runs_tools_in_sandboxes_and_scores_them(tmp_path: Path, close_sandboxes: None) -> None:
    import torch
    from trl import GRPOConfig, GRPOTrainer

    from trl_harbor import HarborBashEnv, HarborSpec
    from trl_harbor.testing import build_model, build_tokenizer, script_tool_calls, tool_call_text

    calls: list[tuple[int, str, str]] = []  # (env id, command, output)
    scored: list[tuple[list[float], list[list[str]]]] = []

    class RecordingBashEnv(HarborBashEnv):
        def bash(self, command: str) -> str:
            """Run a shell command in the sandbox and return its combined stdout and stderr.

            Args:
                command: The shell command to run.

            Returns:
                The command's combined stdout and stderr.
            """
            output = super().bash(command)
            calls.append((id(self), command, output))
            return output

    spec = HarborSpec(
        BUNDLED_SUITE,
        agent=RecordingBashEnv,
        environment_type="local",
        indices=[sorted(p.name for p in BUNDLED_SUITE.iterdir()).index(GOLD_TASK)],
    )
    [harbor_reward] = spec.reward_funcs

    def recorded_reward(completions, environments=None, **kwargs):
        rewards = harbor_reward(completions=completions, environments=environments, **kwargs)
        scored.append((rewards, [[c for e, c, _ in calls if e == id(env)] for env in environments]))
        return rewards

    good, bad = (tool_call_text("bash", {"command": c}) for c in (GOOD_COMMAND, BAD_COMMAND))
    instructions = [p.read_text() for p in BUNDLED_SUITE.glob("*/instruction.md")]
    tokenizer = build_tokenizer(corpus=[*instructions, HarborBashEnv.PROMPT_SUFFIX], extra_tokens=[good, bad])
    model = build_model(tokenizer, seed=0)
    script_tool_calls(model, tokenizer, [good, bad])
    torch.manual_seed(1)

    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        max_steps=1,
        num_generations=2,
        per_device_train_batch_size=2,
        max_completion_length=64,
        max_tool_calling_iterations=2,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=1,  # with this seed the two rollouts end on different answers (reward std > 0)
    )
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        args=args,
        train_dataset=spec.train_dataset,
        environment_factory=spec.environment_factory,
        reward_funcs=[recorded_reward],
    )
    assert [tool.__name__ for tool in trainer.tools] == ["bash"]  # exactly the harness's tool
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()

    assert calls, "the rigged policy must have called the bash tool"
    assert {c for _, c, _ in calls} <= {GOOD_COMMAND, BAD_COMMAND}
    assert all(out == "(empty output, rc=0)" for _, _, out in calls)
    assert scored, "the reward function must have been called"
    rewards, commands = scored[0]
    assert len(rewards) == 2
    for reward, cmds in zip(rewards, commands, strict=True):
        # the verifier scores the last answer written: 1 for the gold answer, else 0
        assert reward == (1.0 if cmds and cmds[-1] == GOOD_COMMAND else 0.0), (reward, cmds)
    # `get_reward` is a second reward source in TRL: it must not count the same score again
    logged = trainer.state.log_history[0]
    assert logged["rewards/recorded_reward/mean"] == pytest.approx(sum(rewards) / len(rewards))
    assert logged["reward"] == pytest.approx(sum(rewards) / len(rewards))
    if len(set(rewards)) > 1:  # a non-zero advantage must move the weights
        assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
