"""Resolving ``agent=`` (the harness) to a :class:`~trl_harbor.training.env.HarborEnv` subclass.

Accepted forms:

- a built-in name from :data:`AGENTS` (``"bash"``, the reference's) or :data:`EXAMPLE_AGENTS`
  (``"bash_steps"``, ``"bash_minimal"``, ``"jupyter"``, ``"terminal_notes"``: ``bash`` with
  ``submit_step`` for multi-step tasks, ``bash`` with a one-line description and no prompt
  suffix for small models, and the harnesses of :mod:`trl_harbor.training.harnesses`, imported only when
  selected, so ``import trl_harbor`` stays light);
- ``"package.module:ClassName"``, imported from ``sys.path``;
- ``"path/to/file.py:ClassName"`` (Windows paths such as ``C:\\work\\env.py:MyEnv`` too),
  loaded from the file;
- a ``HarborEnv`` subclass itself.

``"terminus-2"`` is no harness but a loop-owning agent (Harbor's Terminus-2), which
``HarborSpec`` trains through a ``rollout_func`` (:mod:`trl_harbor.loop.rollout_func`); :func:`resolve_agent`
refuses it with that explanation.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from trl_harbor.training.env import HarborBashEnv, HarborEnv

__all__ = ["AGENTS", "EXAMPLE_AGENTS", "LOOP_AGENT_NAMES", "resolve_agent"]

#: Built-in harnesses selectable by name.
AGENTS: dict[str, type[HarborEnv]] = {"bash": HarborBashEnv}

#: The example harnesses (also loadable by their ``examples/scripts/harbor/harnesses/*/env.py`` paths),
#: selectable by name and imported on first selection.
EXAMPLE_AGENTS: dict[str, str] = {
    "bash_steps": "trl_harbor.training.env:HarborBashStepsEnv",
    "bash_minimal": "trl_harbor.training.harnesses.bash_minimal:MinimalBashEnv",
    "jupyter": "trl_harbor.training.harnesses.jupyter.env:JupyterEnv",
    "terminal_notes": "trl_harbor.training.harnesses.terminal_notes.env:TerminalNotesEnv",
}


#: Names of loop-owning agents (:mod:`trl_harbor.loop.rollout_func`): selectable in ``HarborSpec``, not harness classes.
LOOP_AGENT_NAMES: frozenset[str] = frozenset({"terminus-2", "terminus_2", "terminus2"})


def _load_module_from_file(target: str, agent: str) -> ModuleType:
    path = Path(target).expanduser()
    if not path.is_file():
        raise ValueError(f"agent {agent!r}: the file {path} does not exist.")
    path = path.resolve()
    # A stable, unique module name per file, so classes keep their identity when a spec is
    # built twice and pickling by reference can find the module again in this process.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    name = f"trl_harbor_agent_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"agent {agent!r}: cannot load Python code from {path}.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def resolve_agent(agent: str | type[HarborEnv]) -> type[HarborEnv]:
    """Resolve the ``agent=`` selector of a spec to a ``HarborEnv`` subclass.

    Args:
        agent: A built-in name, ``"package.module:ClassName"``,
            ``"path/to/file.py:ClassName"``, or a ``HarborEnv`` subclass.

    Returns:
        The harness class.

    Raises:
        ValueError: For an unknown built-in name (the message lists the built-ins), or a
            module / file / attribute that cannot be found.
        TypeError: When the selector resolves to something that is not a ``HarborEnv``
            subclass.
    """
    if isinstance(agent, type):
        cls: object = agent
    elif not isinstance(agent, str):
        raise TypeError(f"agent must be a string or a HarborEnv subclass, got {agent!r}")
    elif agent in LOOP_AGENT_NAMES:
        raise ValueError(
            f"agent {agent!r} is a loop-owning agent (Harbor's Terminus-2), not a HarborEnv harness: train it with "
            "HarborSpec(agent='terminus-2') and GRPOTrainer(rollout_func=spec.rollout_func, ...), or "
            "`trl-harbor train --agent terminus-2` (see docs/agents.md)."
        )
    elif agent in AGENTS:
        cls = AGENTS[agent]
    elif agent in EXAMPLE_AGENTS:
        module, _, class_name = EXAMPLE_AGENTS[agent].rpartition(":")
        cls = getattr(importlib.import_module(module), class_name)
    elif ":" in agent and not agent.endswith(":"):
        # rpartition keeps a Windows drive letter ("C:\\x\\env.py:Cls") in the target.
        target, _, class_name = agent.rpartition(":")
        if not target or not class_name.isidentifier():
            raise ValueError(f"agent {agent!r}: expected 'package.module:ClassName' or 'path/to/file.py:ClassName'.")
        if target.endswith(".py") or "/" in target or "\\" in target:  # a file, not a module
            module = _load_module_from_file(target, agent)
        else:
            try:
                module = importlib.import_module(target)
            except ModuleNotFoundError as exc:
                raise ValueError(f"agent {agent!r}: cannot import module {target!r} ({exc}).") from exc
        try:
            cls = getattr(module, class_name)
        except AttributeError:
            raise ValueError(f"agent {agent!r}: {target!r} has no attribute {class_name!r}.") from None
    else:
        raise ValueError(
            f"Unknown agent {agent!r}. Built-in agents: {sorted([*AGENTS, *EXAMPLE_AGENTS, 'terminus-2'])}. "
            "Or pass an import path "
            "'package.module:ClassName', a file path 'path/to/file.py:ClassName', or a HarborEnv subclass."
        )
    if not (isinstance(cls, type) and issubclass(cls, HarborEnv)):
        raise TypeError(f"agent {agent!r} must resolve to a HarborEnv subclass, got {cls!r}.")
    return cls
