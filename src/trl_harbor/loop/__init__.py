"""Loop-owning agents in training: agents that run their own loop and reach the policy over HTTP.

* :mod:`~trl_harbor.loop.capture` — the capture endpoint: the policy being trained, served on
  loopback to such agents, every token recorded (it imports nothing of trl_harbor outside itself);
* :mod:`~trl_harbor.loop.terminus` — Harbor's Terminus-2, run in an episode's sandbox with its
  model at a capture route;
* :mod:`~trl_harbor.loop.rollout_func` — ``LoopRolloutFunc`` (TRL's ``rollout_func``: episode,
  route, agent, grade, row) and ``loop_reward``; :mod:`~trl_harbor.loop.async_worker` — the same
  as ``AsyncGRPOTrainer``'s rollout worker.

A :class:`~trl_harbor.HarborSpec` with ``agent="terminus-2"`` builds its rollout function from here.
"""
