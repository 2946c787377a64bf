"""The harnesses trl-harbor ships besides ``bash``: tool surfaces over a task's sandbox.

- :mod:`trl_harbor.training.harnesses.jupyter` — ``JupyterEnv``: a stateful Python kernel and a shell.
- :mod:`trl_harbor.training.harnesses.terminal_notes` — ``TerminalNotesEnv``: blocking and background
  shell commands, binary-safe file writes, and a notes kit.

Select them with ``HarborSpec(agent="jupyter")`` / ``agent="terminal_notes"``, or by the file
paths the reference integration's users know
(``examples/scripts/harbor/harnesses/jupyter/env.py:JupyterEnv``). They are imported only when
selected.
"""
