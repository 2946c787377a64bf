"""One batch of graded rollouts, as ``GRPOTrainer`` runs it: the corpora of ``test_grading.py`` and ``test_view.py``.

Each case is one rollout (``agent="bash_steps"``): reset on its task, its tool calls, then the whole
batch verified at once by ``spec.reward_funcs``. An outcome records what the case deserved in that
run (``deserves`` with the defences, ``undefended`` without them), what it scored, and every problem:
a different score, or what the case's check for that run found.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from adv_table import GradingOutcome

from trl_harbor import HarborOptions, HarborSpec, close_all


def run_batch(
    root: Path,
    task_of: Callable[[str], str],
    cases: list[Any],
    label: str,
    ctx: Any,
    *,
    command_timeout_sec: int,
    env_kwargs: dict | None = None,
) -> list[GradingOutcome]:
    """Run ``cases`` (``grading_corpus.Case``-like) as one batch of the suite at ``root``.

    Args:
        root: The suite's folder.
        task_of: A case's task folder from its ``kind``.
        cases: The rollouts, in batch order.
        label: ``"defended"`` (each case must score ``deserves`` and pass ``check``) or anything else
            (each must score ``undefended`` and pass ``undefended_check`` where it has one).
        ctx: What the cases' tool calls and checks use (their shell, answers, ...).
        command_timeout_sec: The bash tool's timeout.
        env_kwargs: More of the environment's options (``defences_off``'s, say).

    Returns:
        One outcome a case, in order; every sandbox of the batch is closed.
    """
    spec = HarborSpec(
        root,
        agent="bash_steps",
        environment_type="local",
        options=HarborOptions(command_timeout_sec=command_timeout_sec, **(env_kwargs or {})),
    )
    started = time.monotonic()
    envs = [spec.environment_factory() for _ in cases]
    for env, case in zip(envs, cases, strict=True):
        env.reset(task_dir=task_of(case.kind))
    outputs_of = []
    for env, case in zip(envs, cases, strict=True):
        try:
            outputs = case.calls(ctx, env)
        except Exception as exc:  # TRL's tool loop hands the model the error
            outputs = [exc]
        outputs_of.append(outputs)
    turns = time.monotonic() - started
    extra: dict[str, list] = {}
    rewards = spec.reward_funcs(completions=[None] * len(envs), environments=envs, log_extra=extra.__setitem__)
    graded = time.monotonic() - started - turns
    outcomes = []
    for env, case, outputs, reward, reason in zip(envs, cases, outputs_of, rewards, extra["harbor_error"], strict=True):
        outcomes.append(_outcome(env, case, outputs, reward, reason or "", label, ctx))
    close_all()
    print(
        f"[{label}] {len(cases)} rollouts in {time.monotonic() - started:.0f} s "
        f"(tool calls {turns:.0f} s, grading {graded:.0f} s)"
    )
    return outcomes


def _outcome(
    env: Any, case: Any, outputs: list, reward: float | None, reason: str, label: str, ctx: Any
) -> GradingOutcome:
    outcome = GradingOutcome(case.name, case.klass, label, reward=reward, reason=reason, hole=case.hole)
    if env.verification is not None:
        outcome.concealed = list(env.verification.concealed)
    if label == "defended":
        outcome.expected, check = case.deserves, case.check
        if reward != case.deserves:
            outcome.problems.append(f"scored {reward}, deserved {case.deserves} ({reason})")
    else:
        outcome.expected, check = case.undefended, getattr(case, "undefended_check", None)
        if reward != case.undefended:
            what = "the attack did not win without the defences" if case.klass != "H" else "the honest rollout"
            outcome.problems.append(f"{what}: scored {reward}, expected {case.undefended} ({reason})")
    if check is not None:
        problem = check(ctx, env, outputs)
        if problem:
            outcome.problems.append(problem)
    outcome.output = "\n".join(map(str, outputs))[-400:]
    return outcome
