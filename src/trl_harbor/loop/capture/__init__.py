"""The capture endpoint: the policy being trained, served to loop-owning agents, every token recorded.

* :mod:`~trl_harbor.loop.capture.endpoint` — :class:`CaptureEndpoint`, an OpenAI-compatible server on
  loopback with one :class:`Route` per rollout, replies carrying token ids and log-probabilities;
* :mod:`~trl_harbor.loop.capture.trace` — :class:`Trace`: token-in/token-out turns, forks, retries,
  re-tokenisation drift, and a trajectory as one training :class:`Row`;
* :mod:`~trl_harbor.loop.capture.samplers` — where tokens come from: :class:`ModelSampler` (the
  trainer's model in this process) and :class:`VLLMSampler` (the trainer's vLLM), with the
  endpoint's pinned :class:`SamplingParams`.

It imports nothing of trl_harbor outside itself (aiohttp, and torch or requests in the samplers,
are imported when used), so any trainer or agent harness can use it.
"""

from trl_harbor.loop.capture.endpoint import CaptureEndpoint, Route, serving
from trl_harbor.loop.capture.samplers import (
    Generation,
    GenerationRequest,
    ModelSampler,
    Sampler,
    SamplingParams,
    VLLMSampler,
    derive_seed,
    sampling_from_trainer,
)
from trl_harbor.loop.capture.trace import Fork, Renderer, Row, Trace, Turn

__all__ = [
    "CaptureEndpoint",
    "Fork",
    "Generation",
    "GenerationRequest",
    "ModelSampler",
    "Renderer",
    "Route",
    "Row",
    "Sampler",
    "SamplingParams",
    "Trace",
    "Turn",
    "VLLMSampler",
    "derive_seed",
    "sampling_from_trainer",
    "serving",
]
