"""Per-rollout trajectory log: one JSON line per rollout, written as the batch is scored.

:class:`TrajectoryLog` wraps the two things ``GRPOTrainer`` gets from a :class:`~trl_harbor.HarborSpec`:

- :meth:`TrajectoryLog.environment_factory` builds the harness as a recording subclass (same
  name, same tools, same schemas), whose ``reset`` opens a record and whose every tool call
  appends its name, arguments, output, duration and error to it;
- :meth:`TrajectoryLog.reward_func` wraps the outcome reward: once a batch is verified it writes
  one line per rollout with the step, the task, the harness, every tool call, the final
  message, the reward (and the verifier's reward components where the environment keeps
  them) and the infrastructure error, if any.

.. code-block:: python

    log = TrajectoryLog("outputs/run/trajectories.jsonl")
    trainer = GRPOTrainer(
        ...,
        environment_factory=log.environment_factory(spec.environment_factory),
        reward_funcs=log.reward_func(spec.reward_funcs),
    )

Every process of a multi-process run (``accelerate launch``, ``torchrun``) appends to the same
file, each batch in one locked write; every line names its ``rank``, the ``global_step`` it was
scored at and its ``batch`` (the process's count of scored batches), so ``(rank, batch, rollout)``
identifies a rollout once.
"""

from __future__ import annotations

import fcntl
import functools
import inspect
import json
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from trl_harbor.training.tools import tool_functions

__all__ = ["TrajectoryLog", "read_trajectories", "recording_class"]

_RECORD = "_trl_harbor_trajectory"


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def _record_tool(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def tool(self: Any, *args: Any, **kwargs: Any) -> Any:
        record = getattr(self, _RECORD, None)
        try:
            arguments = dict(signature.bind(self, *args, **kwargs).arguments)
            arguments.pop(next(iter(signature.parameters)), None)  # self
        except TypeError:
            arguments = {"args": list(args), **kwargs}
        call: dict[str, Any] = {"tool": name, "arguments": {k: _jsonable(v) for k, v in arguments.items()}}
        start = time.monotonic()

        def done(output: Any, error: str | None) -> None:
            call.update(output=output, error=error, duration_s=round(time.monotonic() - start, 4))
            if record is not None:
                record["tool_calls"].append(call)

        try:
            output = fn(self, *args, **kwargs)
        except Exception as exc:
            done(None, f"{type(exc).__name__}: {exc}")
            raise
        done(output if isinstance(output, str) else _jsonable(output), None)
        return output

    return tool


def _record_reset(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def reset(self: Any, *args: Any, **kwargs: Any) -> Any:
        task_dir = kwargs.get("task_dir", args[0] if args else None)
        setattr(
            self,
            _RECORD,
            {
                "task": Path(task_dir).name if task_dir else None,
                "task_dir": str(task_dir) if task_dir else None,
                "started_at": datetime.now(UTC).isoformat(timespec="milliseconds"),
                "_t0": time.monotonic(),
                "tool_calls": [],
            },
        )
        return fn(self, *args, **kwargs)

    return reset


@functools.cache
def recording_class(cls: type) -> type:
    """A subclass of a harness that records every rollout's tool calls.

    The subclass keeps the harness's name and every tool's signature and docstring (so the
    model sees the same tools and TRL names the same reward column); ``reset`` opens a new
    record, each tool call appends to it.

    Args:
        cls: The harness (a ``HarborEnv`` subclass).

    Returns:
        The recording subclass (one per harness class).
    """
    namespace: dict[str, Any] = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
    namespace["reset"] = _record_reset(cls.reset)
    for name, fn in tool_functions(cls).items():
        namespace[name] = _record_tool(name, fn)
    return type(cls.__name__, (cls,), namespace)


def _final_message(completion: Any) -> str | None:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        for message in reversed(completion):
            if isinstance(message, dict) and message.get("role") == "assistant":
                content = message.get("content")
                return content if isinstance(content, str) else _jsonable(content)
    return None


class TrajectoryLog:
    """Write one JSON line per rollout: task, harness, tool calls, reward, infrastructure error.

    Args:
        path: The JSONL file (appended to; parent folders are created). In a multi-process
            run every rank appends to this one file (each batch in one locked write); each line
            names its ``rank``.
        environment_type: The backend, recorded on every line.
    """

    def __init__(self, path: str | Path, environment_type: str | None = None) -> None:
        self.path = Path(path)
        self.environment_type = environment_type
        #: This process's rank in a multi-process run (``RANK``), 0 alone.
        self.rank = int(os.environ.get("RANK", "0") or 0)
        self.written = 0
        self.batches = 0
        self._lock = threading.Lock()

    def environment_factory(
        self, factory: Callable[[], Any] | dict[str, Callable[[], Any]]
    ) -> Callable[[], Any] | dict[str, Callable[[], Any]]:
        """Wrap an environment factory so that its environments record their tool calls.

        Args:
            factory: A spec's ``environment_factory``, or a mix's ``{name: factory}`` mapping.

        Returns:
            The same factory building the harness's recording subclass (a mapping of them for a
            mapping); picklable.

        Raises:
            TypeError: For a factory that is not a spec's (its class cannot be known beforehand).
        """
        from trl_harbor.training.spec import EnvironmentFactory

        def recording(one: Any) -> EnvironmentFactory:
            if not isinstance(one, EnvironmentFactory):
                raise TypeError(f"TrajectoryLog records the environments of a HarborSpec's factory, not {one!r}")
            return one.transformed(recording_class)

        if isinstance(factory, dict):
            return {name: recording(f) for name, f in factory.items()}
        return recording(factory)

    def reward_func(self, func: Callable[..., list[float | None]]) -> Callable[..., list[float | None]]:
        """Wrap a reward function so that each scored batch is written to the log.

        Args:
            func: A reward function taking ``environments=`` (``spec.reward_funcs``), or a loop
                agent's taking ``harbor_rollout=`` (the rollouts of ``spec.rollout_func``).

        Returns:
            A reward function with the same name and results.
        """

        @functools.wraps(func)
        def logged(*args: Any, **kwargs: Any) -> list[float | None]:
            rewards = func(*args, **kwargs)
            environments = kwargs.get("environments")
            if environments is None:  # a loop agent's rollout_func hands its rollouts over instead
                environments = kwargs.get("harbor_rollout")
            if environments is not None:
                state = kwargs.get("trainer_state")
                global_step = None if state is None else int(state.global_step)
                self.write(environments, rewards, kwargs.get("completions"), global_step=global_step)
            return rewards

        return logged

    def write(
        self,
        environments: Sequence[Any],
        rewards: Sequence[float | None],
        completions: Sequence[Any] | None = None,
        global_step: int | None = None,
        extra: Sequence[dict[str, Any]] | None = None,
    ) -> None:
        """Append one line per rollout, the batch in one write (whole lines, whatever other processes write).

        Args:
            environments: The rollouts' environments (recording ones carry their tool calls).
            rewards: Their rewards, in the same order.
            completions: Their completions (the last assistant message is recorded).
            global_step: The trainer's ``global_step`` when the batch was scored (the optimizer steps
                done); the line's ``step`` is the step it trains, ``global_step + 1``.
            extra: Per-rollout fields to add to each line (e.g. an endpoint error).
        """
        now = time.monotonic()
        with self._lock:
            self.batches += 1
            batch = self.batches
        lines = []
        for index, (env, reward) in enumerate(zip(environments, rewards, strict=True)):
            line = {
                "step": None if global_step is None else global_step + 1,
                "global_step": global_step,
                "rank": self.rank,
                "batch": batch,
                "rollout": index,
                **self._rollout(env, reward, None if completions is None else completions[index], now),
            }
            if extra is not None:
                line.update(extra[index])
            lines.append(json.dumps(line, ensure_ascii=False))
        if lines:
            self._append(lines)

    def _rollout(self, env: Any, reward: float | None, completion: Any, now: float) -> dict[str, Any]:
        """A line's fields of one rollout: the task, its tool calls, the final message, how it was graded."""
        record = dict(getattr(env, _RECORD, None) or {"task": None, "tool_calls": []})
        t0 = record.pop("_t0", None)
        verification = getattr(env, "verification", None)  # HarborEnv: how the rollout was graded
        components = getattr(verification, "rewards", None)
        line = {
            "task": record.get("task"),
            "task_dir": record.get("task_dir"),
            "harness": type(env).__name__,
            "environment_type": self.environment_type,
            "started_at": record.get("started_at"),
            "duration_s": None if t0 is None else round(now - t0, 3),
            "tool_calls": record.get("tool_calls", []),
            "num_tool_calls": len(record.get("tool_calls", [])),
            "final_message": None if completion is None else _final_message(completion),
            "reward": None if reward is None or (isinstance(reward, float) and math.isnan(reward)) else float(reward),
            "reward_components": _jsonable(dict(components)) if isinstance(components, dict) else None,
            "infra_error": getattr(env, "infra_error", None) if hasattr(type(env), "infra_error") else None,
        }
        if verification is not None:
            cause = getattr(verification, "cause", None)
            line["verification"] = {
                "cause": None if cause is None else str(cause),
                "reason": getattr(verification, "reason", ""),
                "concealed": list(getattr(verification, "concealed", ())),
                "tampered": list(getattr(verification, "tampered", ())),
                "killed": getattr(verification, "killed", 0),
            }
        fields = getattr(env, "trajectory_fields", None)
        if callable(fields):  # a loop agent's rollout: turns, forks, drift, how the agent ended
            line.update(fields())
        return line

    def _append(self, lines: list[str]) -> None:
        """Append whole lines in one locked write, whatever other processes append to the file."""
        data = ("\n".join(lines) + "\n").encode()
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # other ranks append to the same file
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            self.written += len(lines)


def read_trajectories(path: str | Path) -> list[dict[str, Any]]:
    """Read a trajectory log.

    Args:
        path: A JSONL file written by :class:`TrajectoryLog`.

    Returns:
        One dict per rollout, in the order written.

    Raises:
        ValueError: When a line is not JSON (names the file and line).
    """
    rows = []
    with Path(path).open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not a JSON line ({exc})") from exc
    return rows
