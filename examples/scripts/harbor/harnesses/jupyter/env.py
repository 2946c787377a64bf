"""The Jupyter harness, at the path TRL's Harbor guide loads it from.

``HarborSpec(agent="examples/scripts/harbor/harnesses/jupyter/env.py:JupyterEnv")`` (TRL's documented
path), ``HarborSpec(agent="examples/grpo_harbor/harnesses/jupyter/env.py:JupyterEnv")`` (the earlier
path, a symlink to this folder) and ``HarborSpec(agent="jupyter")`` give the same class; it lives in
:mod:`trl_harbor.training.harnesses.jupyter.env` (see the README beside this file).
"""

from trl_harbor.training.harnesses.jupyter.env import JupyterEnv

__all__ = ["JupyterEnv"]
