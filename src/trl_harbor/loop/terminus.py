"""Terminus-2, Harbor's own terminal agent, run on a rollout's sandbox with a model endpoint of ours.

Terminus-2 is not an installed agent: its loop runs on the host, in this process. It reads the
sandbox's terminal through a tmux session it starts *inside* the sandbox (every keystroke and
screen capture is one ``exec``), and it calls its model through litellm at a configurable base
URL. So it drives any Harbor backend's sandbox, and it can be trained: point its model at a
route of the capture endpoint (:mod:`trl_harbor.loop.capture`), which answers with the policy and
records every token.

:func:`run_terminus` runs the real ``harbor.agents.terminus_2.Terminus2`` in an
:class:`~trl_harbor.rollout.Episode`'s sandbox, as Harbor's trial runs it (the task's ``[agent]
user`` as the default user, the setup and agent timeouts), configured for training:

- ``collect_rollout_details=True``: Harbor itself requests and records each call's prompt and
  completion token ids and log-probabilities (compared with the endpoint's, see
  :attr:`AgentRun.harbor_token_ids_match`);
- summarisation off: a summary rewrites the history (a fork), and its three extra model calls
  are not the policy acting on the task; the context's end ends the rollout instead;
- a turn budget (``max_turns``), no terminal recording (asciinema is not in task images and
  must not be installed at run time).

Terminus-2 needs ``tmux`` inside the task's image. Its own fallback installs it with the image's
package manager or builds it from a GitHub tarball, which a sandbox without the network (or
this project's offline machines) cannot do; a sandbox without ``tmux`` therefore fails the
rollout at once, as a configuration error naming the fix (``apt-get install -y tmux`` in the
task's Dockerfile).

Grading is not done here: the caller grades the episode (``await episode.grade()``), the one
grading path of every rollout.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from trl_harbor.options import refuse_unknown
from trl_harbor.rollout import steps
from trl_harbor.rollout.outcome import Cause

if TYPE_CHECKING:
    from trl_harbor.rollout.episode import Episode

__all__ = ["AGENT_NAME", "TERMINUS_OPTION_NAMES", "AgentRun", "TerminusOptions", "run_terminus"]

logger = logging.getLogger(__name__)

#: The name that selects this agent (``HarborSpec(agent=...)``, ``trl-harbor train --agent``).
AGENT_NAME = "terminus-2"

#: The model name the agent is configured with (litellm's ``hosted_vllm`` provider: an OpenAI server).
MODEL_NAME = "hosted_vllm/policy"

# litellm fetches a model price list from GitHub when first imported; offline, use its bundled copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


@dataclass(frozen=True)
class TerminusOptions:
    """How Terminus-2 runs in a training rollout (``HarborSpec(env_kwargs=...)``, ``--ek``-like keys).

    Attributes:
        max_turns: Model calls per rollout (Terminus-2's ``max_turns``). ``None``: the trainer's
            ``max_tool_calling_iterations`` when set, else 10.
        parser_name: Terminus-2's response format: ``"json"`` or ``"xml"``.
        pane_width: The tmux pane's width (columns).
        pane_height: The tmux pane's height (lines): the screen the model reads each turn.
        timeout_sec: Seconds the agent may run (``None``: the task's ``[agent] timeout_sec``).
        setup_timeout_sec: Seconds its setup (the tmux session) may take.
        fork_policy: What a rollout whose history forked trains on: ``"truncate"`` (its first
            segment) or ``"skip"`` (nothing: its reward is ``None``).
    """

    max_turns: int | None = None
    parser_name: str = "json"
    pane_width: int = 160
    pane_height: int = 40
    timeout_sec: float | None = None
    setup_timeout_sec: float = 360.0
    fork_policy: str = "truncate"

    def __post_init__(self) -> None:
        if self.fork_policy not in ("truncate", "skip"):
            raise ValueError(f"fork_policy must be 'truncate' or 'skip', got {self.fork_policy!r}")
        if self.max_turns is not None and (isinstance(self.max_turns, bool) or int(self.max_turns) < 1):
            raise ValueError(f"max_turns must be a positive integer, got {self.max_turns!r}")
        if self.parser_name not in ("json", "xml"):
            raise ValueError(f"parser_name must be 'json' or 'xml', got {self.parser_name!r}")
        if int(self.pane_width) < 20 or int(self.pane_height) < 5:
            raise ValueError("the tmux pane must be at least 20 columns by 5 lines")

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> TerminusOptions:
        """Options from keyword arguments.

        Raises:
            TypeError: For a key that is no option (the message lists them).
        """
        refuse_unknown(kwargs, TERMINUS_OPTION_NAMES, "Terminus-2 option")
        return cls(**dict(kwargs))


#: The fields of :class:`TerminusOptions`.
TERMINUS_OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in fields(TerminusOptions))


@dataclass
class AgentRun:
    """How one Terminus-2 run went (the episode holds the sandbox and, once graded, the reward).

    Attributes:
        ended: ``"completed"`` (the agent marked the task complete and confirmed), ``"max_turns"``,
            ``"context"`` (the policy's context or the rollout's token budget ran out), ``"timeout"``,
            ``"error"`` (the agent raised), ``"aborted"`` (the model endpoint failed), or
            ``"not_started"`` (the sandbox or its tmux could not be set up).
        turns: Model calls Terminus-2 made.
        error: What went wrong, for ``"error"``, ``"aborted"`` and ``"not_started"``.
        steps: Terminus-2's own trajectory (ATIF steps: the message, the commands sent as tool
            calls, the terminal observation).
        rollout_details: Harbor's record of the calls' token ids and log-probabilities.
    """

    ended: str
    turns: int = 0
    error: str | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)
    rollout_details: list[dict[str, Any]] = field(default_factory=list)

    def tool_calls(self) -> list[dict[str, Any]]:
        """The commands the agent sent, as the trajectory log records tool calls.

        Returns:
            One entry per command (``bash_command``: keystrokes, duration) or completion mark
            (``mark_task_complete``), each with the terminal output the agent then read.
        """
        calls = []
        for step in self.steps:
            results = (step.get("observation") or {}).get("results") or []
            output = "\n".join(str(r.get("content")) for r in results if r.get("content") is not None)
            calls += [
                {
                    "tool": call.get("function_name"),
                    "arguments": call.get("arguments") or {},
                    "output": output,
                    "error": None,
                }
                for call in step.get("tool_calls") or []
            ]
        return calls

    def harbor_token_ids(self) -> tuple[list[list[int]], list[list[int]], list[list[float]]]:
        """Harbor's recorded per-call prompt ids, completion ids and log-probabilities (the main chat's)."""
        if not self.rollout_details:
            return [], [], []
        detail = self.rollout_details[0]
        return (
            [list(x) for x in detail.get("prompt_token_ids") or []],
            [list(x) for x in detail.get("completion_token_ids") or []],
            [list(x) for x in detail.get("logprobs") or []],
        )


def model_info(context_tokens: int | None) -> dict[str, Any]:
    """litellm's description of the served model (its context, for Terminus-2's own bookkeeping)."""
    size = int(context_tokens or 1_000_000)
    return {
        "max_input_tokens": size,
        "max_output_tokens": size,
        "max_tokens": size,
        "input_cost_per_token": 0.0,
        "output_cost_per_token": 0.0,
    }


async def run_terminus(
    episode: Episode,
    base_url: str,
    options: TerminusOptions,
    *,
    max_turns: int,
    session_id: str,
    context_tokens: int | None = None,
    abort: Callable[[], Awaitable[Any]] | None = None,
) -> AgentRun:
    """Run Terminus-2 in an episode's sandbox with its model at ``base_url``; never raises for the agent's failures.

    The episode is provisioned by the caller (this waits for it). The agent's processes (its tmux
    server) are left running, as Harbor's trial leaves them for the verifier.

    Args:
        episode: The rollout's episode.
        base_url: The OpenAI base URL of the model (a capture route's ``url``).
        options: How Terminus-2 runs.
        max_turns: Model calls allowed.
        session_id: The agent's session id (sent with every call).
        context_tokens: The served model's context, told to litellm (``None``: unbounded).
        abort: Returns an awaitable that finishes when the run must stop (the model endpoint failed).

    Returns:
        How the run went.
    """
    refused = await _check_sandbox(episode)
    if refused is not None:
        return refused
    task, environment = episode.task, episode.environment
    assert environment is not None
    agent = _build_agent(episode, base_url, options, max_turns, session_id, context_tokens)
    timeout = options.timeout_sec if options.timeout_sec is not None else task.config.agent.timeout_sec
    from harbor.models.agent.context import AgentContext

    context = AgentContext()
    with environment.with_default_user(steps.agent_user(task, episode.step)):
        try:
            await asyncio.wait_for(agent.setup(environment), timeout=options.setup_timeout_sec)
        except Exception as exc:  # noqa: BLE001
            episode.fail("start", f"Terminus-2's setup failed: {type(exc).__name__}: {exc}")
            return AgentRun("not_started", error=episode.failure.reason if episode.failure else str(exc))
        run = await _until_done(agent.run(episode.instruction, environment, context), timeout, abort)
    run.turns = int((context.metadata or {}).get("n_episodes") or 0)
    run.rollout_details = [dict(d) for d in context.rollout_details or []]
    run.steps = _trajectory_steps(episode)
    if run.ended == "completed" and not _confirmed(run.steps):
        run.ended = "max_turns"
    if run.ended == "error":
        logger.info("trl-harbor: Terminus-2 on %s stopped: %s", task.name, run.error)
    return run


async def _check_sandbox(episode: Episode) -> AgentRun | None:
    """Wait for the sandbox; a ``not_started`` run when it did not start or has no tmux (which fails the episode)."""
    await episode.wait_ready()
    if episode.failure is not None or episode.environment is None:
        return AgentRun("not_started", error=episode.failure.reason if episode.failure else "no sandbox")
    try:
        probe = await episode.exec("command -v tmux >/dev/null 2>&1", timeout=60, user="root")
    except Exception as exc:  # noqa: BLE001 - the episode records an infrastructure failure itself
        return AgentRun("not_started", error=f"{type(exc).__name__}: {exc}")
    if probe.return_code == 0:
        return None
    reason = (
        f"the sandbox of task {episode.task.name!r} has no tmux, which Terminus-2 drives the terminal with; add "
        "`RUN apt-get update && apt-get install -y --no-install-recommends tmux` (or the image's package "
        "manager's equivalent) to the task's environment/Dockerfile"
    )
    episode.fail("start", reason, Cause.CONFIGURATION)
    return AgentRun("not_started", error=reason)


async def _until_done(
    job: Coroutine[Any, Any, Any], timeout: float | None, abort: Callable[[], Awaitable[Any]] | None
) -> AgentRun:
    """Run the agent until it returns, raises, runs past ``timeout`` or ``abort`` fires; how it ended."""
    from harbor.llms.base import ContextLengthExceededError

    running = asyncio.ensure_future(job)
    guard = asyncio.ensure_future(abort()) if abort is not None else None
    try:
        done, _ = await asyncio.wait(
            {running, *([guard] if guard else [])}, timeout=timeout, return_when="FIRST_COMPLETED"
        )
        if running not in done:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            aborted = guard is not None and guard in done
            return AgentRun("aborted", error="the model endpoint failed") if aborted else AgentRun("timeout")
    finally:
        if guard is not None:
            guard.cancel()
    error = running.exception()
    if error is None:
        return AgentRun("completed")
    if isinstance(error, ContextLengthExceededError):
        return AgentRun("context")
    return AgentRun("error", error=f"{type(error).__name__}: {error}")


def _build_agent(
    episode: Episode, base_url: str, options: TerminusOptions, max_turns: int, session_id: str, context: int | None
) -> Any:
    from harbor.agents.terminus_2 import Terminus2

    # litellm warns, per agent, that a zero-priced custom model has no cache pricing: not the user's business.
    logging.getLogger("LiteLLM").setLevel(max(logging.getLogger("LiteLLM").level, logging.ERROR))
    episode.paths.agent_dir.mkdir(parents=True, exist_ok=True)
    return Terminus2(
        logs_dir=episode.paths.agent_dir,
        model_name=MODEL_NAME,
        api_base=base_url,
        max_turns=max_turns,
        parser_name=options.parser_name,
        collect_rollout_details=True,
        session_id=session_id,
        enable_summarize=False,
        proactive_summarization_threshold=0,
        model_info=model_info(context),
        tmux_pane_width=options.pane_width,
        tmux_pane_height=options.pane_height,
        record_terminal_session=False,
        suppress_max_turns_warning=True,
        llm_kwargs={"api_key": "trl-harbor-capture"},
    )


def _trajectory_steps(episode: Episode) -> list[dict[str, Any]]:
    """Terminus-2's ATIF trajectory (``trajectory.json`` in the trial's agent folder), its steps."""
    path = episode.paths.agent_dir / "trajectory.json"
    try:
        return list(json.loads(path.read_text(encoding="utf-8")).get("steps") or [])
    except (OSError, ValueError):
        return []


def _confirmed(steps_: list[dict[str, Any]]) -> bool:
    """Whether the agent marked the task complete twice in a row (Terminus-2's confirmed completion)."""
    marks = [
        any(call.get("function_name") == "mark_task_complete" for call in step.get("tool_calls") or [])
        for step in steps_
        if step.get("source") == "agent"
    ]
    return len(marks) >= 2 and marks[-1] and marks[-2]
