"""The Jupyter harness, at the path users of ``trl.experimental.harbor`` load it from.

``HarborSpec(agent="examples/grpo_harbor/harnesses/jupyter/env.py:JupyterEnv")`` and
``HarborSpec(agent="jupyter")`` give the same class; it lives in
:mod:`trl_harbor.training.harnesses.jupyter.env` (see the README beside this file).
"""

from trl_harbor.training.harnesses.jupyter.env import JupyterEnv

__all__ = ["JupyterEnv"]
