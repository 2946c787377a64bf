"""The TRL surface: what a ``GRPOTrainer`` is given, and the trainer trl-harbor adds.

* :mod:`~trl_harbor.training.spec` — :class:`HarborSpec`: a suite as ``train_dataset``,
  ``environment_factory``, ``reward_funcs`` (and a loop-owning agent's ``rollout_func``);
* :mod:`~trl_harbor.training.env` — :class:`HarborEnv`, the sandbox-backed TRL environment, over a
  rollout core :class:`~trl_harbor.rollout.Episode`; :mod:`~trl_harbor.training.agents` and
  :mod:`~trl_harbor.training.harnesses` — the harnesses ``agent=`` names;
* :mod:`~trl_harbor.training.rewards` — ``harbor_reward`` and the batch's metrics;
  :mod:`~trl_harbor.training.mix` — several specs as one;
* :mod:`~trl_harbor.training.trainer` — :class:`HarborGRPOTrainer`; :mod:`~trl_harbor.training.freezing`,
  :mod:`~trl_harbor.training.shared_prefix`, :mod:`~trl_harbor.training.trl_compat` (what it needs
  of TRL's internals), :mod:`~trl_harbor.training.tools` (TRL's rule for an environment's tools).

Users import the public names from :mod:`trl_harbor`; nothing here is imported with it.
"""
