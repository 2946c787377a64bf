"""Harbor's Terminus-2 trained through the capture endpoint: the real agent, sandboxes, verifier and GRPOTrainer.

The policy is a tiny Qwen3 model rigged to answer every turn with one whole Terminus-2 reply
(``tests/terminus_helpers.py``): one that writes the right answer, one a wrong one. Terminus-2
asks to confirm a completion, so each rollout takes two turns, the second after the terminal's
output — the observation, which must be masked out of the loss exactly.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import one_step_grpo_config, requires_local
from terminus_helpers import (
    ANSWER,
    RIGHT,
    TAMPER,
    TASK,
    WRONG,
    policy_distribution,
    scripted_policy,
    seed_for,
    tmux_suite,
)

pytestmark = [requires_local, pytest.mark.usefixtures("close_sandboxes")]


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmux_suite(tmp_path_factory.mktemp("terminus"))


def _trainer(tmp_path: Path, spec, model, tokenizer, seed: int):
    from trl import GRPOTrainer

    args = one_step_grpo_config(
        tmp_path, max_completion_length=1024, max_tool_calling_iterations=4, learning_rate=0.05, seed=seed
    )
    return GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        args=args,
        train_dataset=spec.train_dataset,
        environment_factory=spec.environment_factory,
        rollout_func=spec.rollout_func,
        reward_funcs=spec.reward_funcs,
    )


@pytest.mark.slow
def test_terminus_grpo_step_captures_every_token(suite: Path, tmp_path: Path) -> None:
    import torch

    from trl_harbor import HarborSpec
    from trl_harbor.cli.trajectories import TrajectoryLog, read_trajectories

    model, tokenizer = scripted_policy([RIGHT, WRONG])
    right, wrong = (tokenizer.convert_tokens_to_ids(r) for r in (RIGHT, WRONG))
    seed = seed_for([[right, right], [wrong, wrong]], policy_distribution(model, tokenizer), turns=2)
    spec = HarborSpec(suite, agent="terminus-2", environment_type="local", env_kwargs={"pane_height": 8})
    assert spec.environment_factory is None and spec.rollout_func is not None
    log = TrajectoryLog(tmp_path / "trajectories.jsonl", environment_type="local")
    trainer = _trainer(tmp_path, spec, model, tokenizer, seed)
    trainer.reward_funcs = [log.reward_func(f) for f in trainer.reward_funcs]

    batches = []
    generate = trainer._generate_and_score_completions

    def recorded(inputs):
        out = generate(inputs)
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        with torch.no_grad():  # the trainer's own recomputation, before the step
            logps, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, mask, out["completion_ids"].size(1)
            )
        batches.append((out, logps))
        return out

    trainer._generate_and_score_completions = recorded
    before = trainer.model.lm_head.weight.detach().clone()
    trainer.train()
    spec.rollout_func.close()

    assert trainer.state.global_step == 1, "one optimiser step"
    assert not torch.equal(before, trainer.model.lm_head.weight.detach()), "the step changed the policy"
    rollouts = spec.rollout_func.last
    assert len(rollouts) == 2 and len(batches) == 1
    out, recomputed = batches[0]
    by_answer = {}
    for index, rollout in enumerate(rollouts):
        trace = rollout.route.trace
        turns = trace.turns
        assert len(turns) >= 2, f"rollout {index}: {len(turns)} turn(s)"
        assert trace.forks == [] and trace.retries == 0
        assert trace.drift_turns == 0, [t.drift for t in turns]  # TRL's Qwen3 template re-renders this history alike
        sampled = {tuple(t.completion_ids) for t in turns}
        assert len(sampled) == 1, "the seed draws one reply per rollout"
        reply = next(iter(sampled))[0]
        assert next(iter(sampled)) == (reply, tokenizer.eos_token_id)
        by_answer[reply] = rollout
        # The row: the first prompt, then reply, bridge, reply; the bridge masked, exactly.
        row = rollout.row
        assert row.prompt_ids == turns[0].prompt_ids
        n = len(row.completion_ids)
        assert out["completion_ids"][index, :n].tolist() == row.completion_ids
        assert out["tool_mask"][index, :n].tolist() == row.env_mask
        assert out["completion_mask"][index, n:].sum() == 0
        masked = [tok for tok, keep in zip(row.completion_ids, row.env_mask, strict=True) if not keep]
        assert masked == [tok for turn in turns[1:] for tok in turn.bridge_ids]
        bridge = tokenizer.decode(turns[1].bridge_ids)
        assert bridge.startswith("\n<|im_start|>user\n") and bridge.endswith("<|im_start|>assistant\n")
        assert "Are you sure you want to mark the task as complete?" in bridge
        assert f"echo {ANSWER if reply == right else '12.00'} > /workdir/answer.txt" in bridge  # the terminal's echo
        kept = [tok for tok, keep in zip(row.completion_ids, row.env_mask, strict=True) if keep]
        assert kept == [tok for turn in turns for tok in turn.completion_ids]
        # The endpoint's log-probabilities are the trainer's recomputation at step 0.
        positions = [i for i, keep in enumerate(row.env_mask) if keep]
        for position in positions:
            assert math.isclose(row.logprobs[position], float(recomputed[index, position]), abs_tol=1e-4), position
        # Harbor's own record of the calls is the endpoint's.
        prompts, completions, logprobs = rollout.run.harbor_token_ids()
        assert prompts == [t.prompt_ids for t in turns]
        assert completions == [t.completion_ids for t in turns]
        assert rollout.harbor_token_ids_match is True
        assert rollout.run.ended == "completed" and rollout.route.overridden == {}
    assert set(by_answer) == {right, wrong}
    assert by_answer[right].reward == 1.0 and by_answer[right].verification.cause is None
    assert by_answer[wrong].reward == 0.0 and by_answer[wrong].verification.cause is None

    lines = read_trajectories(log.path)
    assert len(lines) == 2 and {line["reward"] for line in lines} == {0.0, 1.0}
    for line in lines:
        assert line["harness"] == "terminus-2" and line["task"] == TASK
        assert line["forks"] == [] and line["turns"] >= 2 and line["harbor_token_ids_match"] is True
        assert [c["tool"] for c in line["tool_calls"]][:2] == ["bash_command", "mark_task_complete"]
    history = trainer.state.log_history[0]
    assert history["harbor/loop/forks"] == 0 and history["harbor/loop/token_mismatch"] == 0
    assert history["harbor/loop/turns"] >= 2


@pytest.mark.slow
def test_terminus_tampering_scores_zero(suite: Path) -> None:
    from trl_harbor import HarborSpec, runtime
    from trl_harbor.loop.capture import CaptureEndpoint, ModelSampler, Renderer, SamplingParams

    model, tokenizer = scripted_policy([TAMPER])
    spec = HarborSpec(suite, agent="terminus-2", environment_type="local", env_kwargs={"pane_height": 8})
    sampling = SamplingParams(max_tokens=64, seed=0)
    endpoint = CaptureEndpoint(ModelSampler(model, [tokenizer.eos_token_id], sampling), Renderer(tokenizer), sampling)
    runtime.run(endpoint.start())
    try:
        [rollout] = spec.rollout_func.run_batch(endpoint, [str(suite / TASK)], [0], budget=1024, max_turns=3)
    finally:
        runtime.run(endpoint.stop())
    assert rollout.turns >= 2 and rollout.run.ended == "completed"
    assert rollout.reward == 0.0, rollout.verification
    assert rollout.verification.cause is None  # graded on its (wrong) answer, the fake grader unseen
    assert any("/usr/local/bin/python3" in str(c) for c in rollout.verification.concealed)


def test_terminus_without_tmux_is_a_configuration_error(bundled_suite: Path) -> None:
    from trl_harbor import HarborSpec, runtime
    from trl_harbor.loop.capture import CaptureEndpoint, ModelSampler, Renderer, SamplingParams

    model, tokenizer = scripted_policy([RIGHT])
    spec = HarborSpec(bundled_suite, agent="terminus-2", environment_type="local", indices=[0])
    sampling = SamplingParams(max_tokens=8, seed=0)
    endpoint = CaptureEndpoint(ModelSampler(model, [tokenizer.eos_token_id], sampling), Renderer(tokenizer), sampling)
    runtime.run(endpoint.start())
    try:
        [rollout] = spec.rollout_func.run_batch(endpoint, [str(spec.task_dirs[0])], [0], budget=64, max_turns=2)
    finally:
        runtime.run(endpoint.stop())
    assert rollout.run.ended == "not_started" and rollout.turns == 0
    assert rollout.reward is None and "no tmux" in rollout.infra_error and "apt-get install" in rollout.infra_error


@pytest.mark.slow
def test_trl_harbor_train_runs_terminus(suite: Path, tmp_path: Path) -> None:
    """``trl-harbor train --agent terminus-2 --model CHECKPOINT``: TRL's rollout_func path from the command line."""
    import json

    from trl_harbor.cli import main as cli_main
    from trl_harbor.cli.trajectories import read_trajectories

    model, tokenizer = scripted_policy([RIGHT, WRONG])
    checkpoint = tmp_path / "policy"
    model.save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    out = tmp_path / "run"
    argv = [
        "train", "--model", str(checkpoint), "--agent", "terminus-2", "--dataset", str(suite),
        "--environment_type", "local", "--num_generations", "2", "--per_device_train_batch_size", "2",
        "--max_steps", "1", "--max_completion_length", "1024", "--max_tool_calling_iterations", "3",
        "--use_cpu", "--report_to", "none", "--save_strategy", "no", "--output_dir", str(out),
    ]  # fmt: skip
    assert cli_main(argv) == 0
    lines = read_trajectories(out / "trajectories.jsonl")
    assert len(lines) == 2
    assert all(line["harness"] == "terminus-2" and line["turns"] >= 2 and line["forks"] == [] for line in lines)
    assert {line["reward"] for line in lines} <= {0.0, 1.0}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["rollouts"] == 2


def test_spec_selects_terminus_and_refuses_what_it_cannot_run(copy_tasks, tmp_path: Path) -> None:
    from trl_harbor import HarborSpec
    from trl_harbor.loop.rollout_func import loop_reward
    from trl_harbor.rollout.suite import TaskSuiteError
    from trl_harbor.training.agents import resolve_agent
    from trl_harbor.training.mix import HarborMixError

    suite = copy_tasks(TASK)
    spec = HarborSpec(suite, agent="Terminus-2", environment_type="local", env_kwargs={"max_turns": 5})
    assert spec.loop_agent == "terminus-2" and spec.env_cls is None and spec.environment_factory is None
    assert spec.agent_options.max_turns == 5 and spec.reward_funcs is loop_reward
    [prompt] = spec.train_dataset["prompt"]
    assert prompt[0]["task_dir"] == str(suite / TASK) and prompt[0]["content"].startswith("# March humidity")
    assert HarborSpec(suite, environment_type="local").rollout_func is None
    from trl_harbor.loop.async_worker import HarborRolloutWorker
    from trl_harbor.loop.capture import VLLMSampler
    from trl_harbor.training.trl_compat import async_grpo

    _, AsyncGRPOConfig = async_grpo()

    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "async"), vllm_server_base_url="http://127.0.0.1:9", num_generations=4,
        max_completion_length=2048, max_tool_calling_iterations=7, report_to="none", use_cpu=True,
    )  # fmt: skip
    worker = HarborRolloutWorker.from_config(spec, args, scripted_policy([RIGHT])[1])
    assert isinstance(worker.sampler, VLLMSampler) and worker.sampler.base_url == "http://127.0.0.1:9"
    assert (worker.max_turns, worker.budget, worker.num_generations) == (5, 2048, 4)  # the spec's max_turns wins
    with pytest.raises(TypeError, match="unknown Terminus-2 option"):
        HarborSpec(suite, agent="terminus-2", env_kwargs={"max_turn": 5})
    with pytest.raises(ValueError, match="reward_source"):
        HarborSpec(suite, agent="terminus-2", reward_source="environment")
    with pytest.raises(ValueError, match="loop-owning agent"):
        resolve_agent("terminus-2")
    with pytest.raises(HarborMixError, match="cannot be mixed"):
        HarborSpec.mix([spec, HarborSpec(suite, environment_type="local")])
    steps = tmp_path / "steps"
    (steps / "two").mkdir(parents=True)
    (steps / "two" / "task.toml").write_text('version = "1.0"\n\n[[steps]]\nname = "a"\n\n[[steps]]\nname = "b"\n')
    for name in ("a", "b"):
        (steps / "two" / "steps" / name / "tests").mkdir(parents=True)
        (steps / "two" / "steps" / name / "instruction.md").write_text("do it")
        (steps / "two" / "steps" / name / "tests" / "test.sh").write_text("#!/bin/sh\n")
    (steps / "two" / "environment").mkdir()
    (steps / "two" / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\n")
    with pytest.raises(TaskSuiteError, match="single-step tasks only"):
        HarborSpec(steps, agent="terminus-2", environment_type="local")


@pytest.mark.slow
def test_async_grpo_worker_puts_scored_rows_on_its_buffer(suite: Path) -> None:
    """The AsyncGRPO rollout worker (``AsyncGRPOTrainer`` itself needs a GPU: FlashAttention-3 tree attention)."""
    from trl_harbor import HarborSpec
    from trl_harbor.loop.async_worker import HarborRolloutWorker
    from trl_harbor.loop.capture import ModelSampler, SamplingParams
    from trl_harbor.training.trl_compat import rollout_sample_class

    RolloutSample = rollout_sample_class()

    model, tokenizer = scripted_policy([RIGHT, WRONG])
    spec = HarborSpec(suite, agent="terminus-2", environment_type="local", env_kwargs={"pane_height": 8})
    sampling = SamplingParams(max_tokens=64, seed=0)
    worker = HarborRolloutWorker(
        spec.rollout_func, spec.train_dataset, tokenizer,
        sampler=ModelSampler(model, [tokenizer.eos_token_id], sampling), sampling=sampling,
        num_generations=2, max_turns=3, budget=1024, max_inflight_groups=1, queue_maxsize=2, seed=0,
    )  # fmt: skip
    worker.update_model_version(3)
    worker.start()
    try:
        samples = [worker.rollout_buffer.get(timeout=600) for _ in range(2)]
        worker.check_health(600)
    finally:
        worker.stop()
    assert all(isinstance(s, RolloutSample) for s in samples)
    assert {s.group_id for s in samples} == {0} and {s.model_version for s in samples} == {3}
    rewards = [s.metrics["reward"] for s in samples]
    assert set(rewards) <= {0.0, 1.0}
    expected = [0.0, 0.0] if rewards[0] == rewards[1] else [1.0 if r == 1.0 else -1.0 for r in rewards]
    assert [s.advantage for s in samples] == pytest.approx(expected, abs=1e-6)
    right = tokenizer.convert_tokens_to_ids(RIGHT)
    for sample, reward in zip(samples, rewards, strict=True):
        ids, mask, logprobs = sample.input_ids.tolist(), sample.completion_mask.tolist(), sample.old_log_probs.tolist()
        assert len(ids) == len(mask) == len(logprobs)
        trained = [token for token, keep in zip(ids, mask, strict=True) if keep]
        assert len(trained) >= 4 and trained[1::2] == [tokenizer.eos_token_id] * (len(trained) // 2)
        assert (trained[-2] == right) == (reward == 1.0)  # the last reply written is what was graded
        assert all(lp == 0.0 for lp, keep in zip(logprobs, mask, strict=True) if not keep)
        assert all(
            lp < 0
            for lp, keep, token in zip(logprobs, mask, ids, strict=True)
            if keep and token != tokenizer.eos_token_id
        )
