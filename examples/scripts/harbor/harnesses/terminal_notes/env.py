"""The TerminalNotes harness, at the path TRL's Harbor guide loads it from.

``HarborSpec(agent="examples/scripts/harbor/harnesses/terminal_notes/env.py:TerminalNotesEnv")`` (TRL's documented
path), ``HarborSpec(agent="examples/grpo_harbor/harnesses/terminal_notes/env.py:TerminalNotesEnv")`` (the earlier
path, a symlink to this folder) and ``HarborSpec(agent="terminal_notes")`` give the same class; it lives in
:mod:`trl_harbor.training.harnesses.terminal_notes.env` (see the README beside this file).
"""

from trl_harbor.training.harnesses.terminal_notes.env import TerminalNotesEnv

__all__ = ["TerminalNotesEnv"]
