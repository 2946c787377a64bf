"""The ``bash_minimal`` harness: one ``bash`` tool, a one-line description, no prompt suffix.

Built for small models (the embedded default run trains a 135M one). ``HarborBashEnv``'s tool
description and prompt suffix explain the sandbox at length and quote example commands; a
135M model copies those quotes into its tool call's JSON and breaks it (no well-formed call,
reward flat at 0). This harness hands the model the instruction alone and a schema of a few
words; the prompt's examples (``trl-harbor train --few_shot``) show it the format instead.

Select it with ``HarborSpec(dataset, agent="bash_minimal")`` or ``--agent bash_minimal``.
"""

from __future__ import annotations

from trl_harbor.training.env import HarborEnv

__all__ = ["MinimalBashEnv"]


class MinimalBashEnv(HarborEnv):
    """One stateless ``bash`` tool with a one-line description, and no ``PROMPT_SUFFIX``."""

    PROMPT_SUFFIX = ""

    def bash(self, command: str) -> str:
        """Run a shell command in the sandbox and return its output.

        Args:
            command: The shell command to run.
        """
        return self._exec(command)
