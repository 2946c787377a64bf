"""The TerminalNotes harness, at the path users of ``trl.experimental.harbor`` load it from.

``HarborSpec(agent="examples/grpo_harbor/harnesses/terminal_notes/env.py:TerminalNotesEnv")``
and ``HarborSpec(agent="terminal_notes")`` give the same class; it lives in
:mod:`trl_harbor.training.harnesses.terminal_notes.env` (see the README beside this file).
"""

from trl_harbor.training.harnesses.terminal_notes.env import TerminalNotesEnv

__all__ = ["TerminalNotesEnv"]
