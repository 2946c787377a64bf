"""A real ``GRPOTrainer`` step on CPU with ``HarborSpec`` and the local sandbox.

The policy is a tiny ``Qwen3ForCausalLM`` built on the fly, rigged (see
``trl_harbor.testing.script_tool_calls``) to answer every prompt with one of two ``bash`` tool
calls — one writes the gold answer, one a wrong answer — so tools really run in sandboxes and
the verifier's rewards differ within the group.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import BUNDLED_SUITE, GOLD_ANSWER, GOLD_TASK, requires_local, tiny_grpo_trainer

from sandbox_helpers import recording_bash_env

GOOD_COMMAND = f"echo -n {GOLD_ANSWER} > /workdir/answer.txt"
BAD_COMMAND = "echo -n 0 > /workdir/answer.txt"


@requires_local
@pytest.mark.slow
def test_grpo_step_runs_tools_in_sandboxes_and_scores_them(tmp_path: Path, close_sandboxes: None) -> None:
    import torch

    from trl_harbor import HarborBashEnv, HarborSpec
    from trl_harbor.testing import tool_call_text

    calls: list[tuple[int, str, str]] = []  # (env id, command, output)
    scored: list[tuple[list[float], list[list[str]]]] = []

    RecordingBashEnv = recording_bash_env(lambda env, command, output: calls.append((id(env), command, output)))

    spec = HarborSpec(
        BUNDLED_SUITE,
        agent=RecordingBashEnv,
        environment_type="local",
        indices=[sorted(p.name for p in BUNDLED_SUITE.iterdir()).index(GOLD_TASK)],
    )
    harbor_reward = spec.reward_funcs

    def recorded_reward(completions, environments=None, **kwargs):
        rewards = harbor_reward(completions=completions, environments=environments, **kwargs)
        scored.append((rewards, [[c for e, c, _ in calls if e == id(env)] for env in environments]))
        return rewards

    good, bad = (tool_call_text("bash", {"command": c}) for c in (GOOD_COMMAND, BAD_COMMAND))
    trainer = tiny_grpo_trainer(tmp_path, spec, [good, bad], HarborBashEnv.PROMPT_SUFFIX, [recorded_reward])
    model = trainer.model
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
    # The harness has no `get_reward` (as in the reference): the reward function is the only reward source.
    logged = trainer.state.log_history[0]
    assert logged["rewards/recorded_reward/mean"] == pytest.approx(sum(rewards) / len(rewards))
    assert logged["reward"] == pytest.approx(sum(rewards) / len(rewards))
    if len(set(rewards)) > 1:  # a non-zero advantage must move the weights
        assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
