"""Where the capture endpoint's tokens come from: the policy being trained, token ids in, token ids out.

A sampler takes prompts as token ids and returns the sampled token ids and their
log-probabilities — never text, so what the endpoint records is exactly what the policy saw and
produced. Sampling parameters are the endpoint's (:class:`SamplingParams`, pinned once from the
trainer's configuration), not the agent's.

- :class:`ModelSampler`: the trainer's own ``transformers`` model in this process (CPU, or one GPU
  without vLLM): one request after another, a seeded generator per request.
- :class:`VLLMSampler`: the trainer's vLLM — a ``trl vllm-serve`` server (``use_vllm=True``,
  ``vllm_mode="server"``) through its OpenAI ``/v1/completions`` route with token-id prompts, many
  requests in flight, or the colocated engine (``vllm_mode="colocate"``), one batch at a time.

Log-probabilities are those GRPO recomputes: ``log_softmax(logits / temperature)`` of the sampled
token, before top-k/top-p truncation (vLLM's ``processed_logprobs``, which TRL sets up).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "Generation",
    "GenerationRequest",
    "ModelSampler",
    "Sampler",
    "SamplingParams",
    "VLLMSampler",
    "derive_seed",
    "sampling_from_trainer",
]


@dataclass(frozen=True)
class SamplingParams:
    """The endpoint's sampling parameters (the agent's are ignored).

    Attributes:
        temperature: Softmax temperature (> 0).
        top_p: Nucleus mass kept (1.0: all).
        top_k: Tokens kept (0: all).
        min_p: Minimum probability relative to the most likely token (0.0: off).
        max_tokens: The most tokens one call samples (the rollout's remaining budget lowers it).
        seed: The base of every request's seed (``None``: unseeded).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 1024
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be positive, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")


@dataclass(frozen=True)
class GenerationRequest:
    """One model call.

    Attributes:
        prompt_ids: The prompt.
        max_tokens: The most tokens to sample.
        seed: This call's seed (``None``: unseeded).
    """

    prompt_ids: list[int]
    max_tokens: int
    seed: int | None = None


@dataclass(frozen=True)
class Generation:
    """What one call sampled.

    Attributes:
        completion_ids: The sampled tokens (ending with a stop token unless cut by ``max_tokens``).
        logprobs: One log-probability per sampled token.
        finish_reason: ``"stop"`` or ``"length"``.
    """

    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str


class Sampler(Protocol):
    """What the endpoint needs of a policy backend.

    Attributes:
        max_batch: The most requests one :meth:`generate` call takes.
        concurrency: How many :meth:`generate` calls may run at once (each on its own thread).
    """

    max_batch: int
    concurrency: int

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        """Sample every request (blocking; called on a worker thread)."""
        ...


def derive_seed(*parts: Any) -> int:
    """A stable 63-bit seed from any parts (a base seed, a step, a rollout, a turn)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def sampling_from_trainer(trainer: Any, max_tokens: int | None = None) -> SamplingParams:
    """The endpoint's sampling parameters from a TRL trainer's configuration.

    Args:
        trainer: A ``GRPOTrainer`` (its ``args``: ``temperature``, ``top_p``, ``top_k``, ``min_p``,
            ``max_completion_length``, ``seed``).
        max_tokens: The most tokens per call (default: ``max_completion_length``).

    Returns:
        The parameters.

    Raises:
        ValueError: For a ``repetition_penalty`` other than 1 (the endpoint does not apply one).
    """
    args = trainer.args
    if getattr(args, "repetition_penalty", None) not in (None, 1, 1.0):
        raise ValueError(
            f"repetition_penalty={args.repetition_penalty}: the capture endpoint samples without one "
            "(a penalty would make the sampled log-probabilities differ from the trainer's); leave it at 1.0"
        )
    return SamplingParams(
        temperature=float(args.temperature),
        top_p=float(args.top_p if args.top_p is not None else 1.0),
        top_k=int(args.top_k or 0),
        min_p=float(args.min_p or 0.0),
        max_tokens=int(max_tokens or args.max_completion_length),
        seed=int(args.seed),
    )


def _truncate(logits: Any, params: SamplingParams) -> Any:
    """Scaled logits with what top-k, top-p and min-p leave out set to -inf."""
    import torch

    if params.top_k and params.top_k < logits.size(-1):
        kth = torch.topk(logits, params.top_k).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.min_p > 0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
        drop = cumulative - torch.softmax(ordered, dim=-1) > params.top_p
        logits = logits.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    return logits


class ModelSampler:
    """The trainer's own ``transformers`` model, sampled in this process (one request at a time).

    Each request decodes with the model's key/value cache from its prompt, with a
    ``torch.Generator`` seeded by the request, so a rollout samples the same tokens on every run.
    The model is used as it is (no copy): the trainer's current weights.

    Args:
        model: A causal LM (``transformers``), e.g. ``trainer.model`` unwrapped.
        stop_token_ids: Tokens that end a turn (the tokenizer's end-of-turn token, ...).
        sampling: The endpoint's parameters.
    """

    max_batch = 1
    concurrency = 1

    def __init__(self, model: Any, stop_token_ids: Sequence[int], sampling: SamplingParams) -> None:
        self.model = model
        self.stop = {int(t) for t in stop_token_ids}
        self.sampling = sampling

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        """Sample each request in turn."""
        return [self._one(request) for request in requests]

    def _one(self, request: GenerationRequest) -> Generation:
        import torch

        params = self.sampling
        device = next(self.model.parameters()).device
        generator = torch.Generator(device="cpu")
        if request.seed is not None:
            generator.manual_seed(request.seed)
        else:
            generator.seed()
        ids: list[int] = []
        logprobs: list[float] = []
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([request.prompt_ids], device=device), use_cache=True)
            for _ in range(request.max_tokens):
                logits = out.logits[0, -1].float() / params.temperature
                logp = torch.log_softmax(logits, dim=-1)
                probs = torch.softmax(_truncate(logits, params), dim=-1).cpu()
                token = int(torch.multinomial(probs, 1, generator=generator).item())
                ids.append(token)
                logprobs.append(float(logp[token]))
                if token in self.stop:
                    return Generation(ids, logprobs, "stop")
                out = self.model(input_ids=torch.tensor([[token]], device=device), use_cache=True, **_cache_of(out))
        return Generation(ids, logprobs, "length")


class VLLMSampler:
    """The trainer's vLLM: a server (many requests in flight) or the colocated engine (one batch at a time).

    With a server, each request is one ``POST {base_url}/v1/completions`` with the prompt as token
    ids, the endpoint's sampling parameters and the request's seed, asking for token ids and the
    sampled token's log-probability (``logprobs=0``, ``return_token_ids``,
    ``return_tokens_as_token_ids``), which is what ``trl vllm-serve`` and vLLM's own OpenAI server
    answer; any rank may call it. With the colocated engine (``vllm.LLM``), a batch of requests is
    one ``generate`` call with one ``SamplingParams`` per request.

    Not run on a GPU in this project's CI (there is none): the server path is tested against a
    stand-in HTTP server that answers ``/v1/completions`` from a CPU model
    (``tests/fake_vllm.py``), the colocated path not at all.

    Args:
        sampling: The endpoint's parameters.
        base_url: The vLLM server (e.g. ``http://127.0.0.1:8000``); exclusive with ``llm``.
        llm: A colocated ``vllm.LLM``.
        model: The served model's name (default: the server's first ``/v1/models`` entry).
        concurrency: Requests in flight against a server.
        timeout: Seconds one server request may take.
    """

    def __init__(
        self,
        sampling: SamplingParams,
        *,
        base_url: str | None = None,
        llm: Any = None,
        model: str | None = None,
        concurrency: int = 64,
        timeout: float = 600.0,
    ) -> None:
        if (base_url is None) == (llm is None):
            raise ValueError("VLLMSampler needs a server's base_url or a colocated llm, not both")
        self.sampling = sampling
        self.base_url = None if base_url is None else base_url.rstrip("/")
        self.llm = llm
        self.timeout = timeout
        self.max_batch = 1 if llm is None else 256
        self.concurrency = concurrency if llm is None else 1
        self._model = model
        self._session: Any = None

    @classmethod
    def from_trainer(cls, trainer: Any, sampling: SamplingParams) -> VLLMSampler:
        """The vLLM of a ``GRPOTrainer`` with ``use_vllm=True``.

        Args:
            trainer: The trainer.
            sampling: The endpoint's parameters.

        Returns:
            A sampler on its server, or on its colocated engine.
        """
        generation = trainer.vllm_generation
        if getattr(generation, "mode", None) == "colocate":
            return cls(sampling, llm=generation.llm)
        args = trainer.args
        base = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
        return cls(sampling, base_url=base, timeout=float(getattr(args, "vllm_server_timeout", 600.0)))

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        """Sample every request (one HTTP call each, or one engine call for the batch)."""
        if self.llm is not None:
            return self._colocated(requests)
        return [self._served(request) for request in requests]

    def _post(self, path: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
        import requests

        if self._session is None:
            self._session = requests.Session()
        url = f"{self.base_url}{path}"
        if payload is None:
            response = self._session.get(url, timeout=self.timeout)
        else:
            response = self._session.post(url, json=payload, timeout=self.timeout)
        if response.status_code != 200:
            raise RuntimeError(f"vLLM {path} answered {response.status_code}: {response.text[:500]}")
        return response.json()

    def _served(self, request: GenerationRequest) -> Generation:
        if self._model is None:
            self._model = self._post("/v1/models")["data"][0]["id"]
        payload: dict[str, Any] = {
            "model": self._model,
            "prompt": [list(request.prompt_ids)],
            **_vllm_sampling(self.sampling, request.max_tokens),
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        if request.seed is not None:
            payload["seed"] = request.seed
        choice = self._post("/v1/completions", payload)["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        logprobs = [_finite(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
        if len(logprobs) != len(ids):
            raise RuntimeError(f"vLLM returned {len(ids)} tokens but {len(logprobs)} log-probabilities")
        return Generation(ids, logprobs, "length" if choice.get("finish_reason") == "length" else "stop")

    def _colocated(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        from vllm import SamplingParams as VllmSamplingParams

        prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests]
        sampling = [VllmSamplingParams(**_vllm_sampling(self.sampling, r.max_tokens), seed=r.seed) for r in requests]
        generations = []
        for output in self.llm.generate(prompts, sampling_params=sampling, use_tqdm=False):
            sample = output.outputs[0]
            ids = list(sample.token_ids)
            logprobs = [_finite(step[token].logprob) for step, token in zip(sample.logprobs, ids, strict=True)]
            generations.append(Generation(ids, logprobs, "length" if sample.finish_reason == "length" else "stop"))
        return generations


def _vllm_sampling(params: SamplingParams, max_tokens: int) -> dict[str, Any]:
    """What vLLM's server and its engine both take: one sample, its log-probability (top-k off is -1)."""
    return {"n": 1, "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k or -1,
            "min_p": params.min_p, "max_tokens": max_tokens, "logprobs": 0}  # fmt: skip


def _cache_of(output: Any) -> dict[str, Any]:
    """The key/value cache of a forward pass, as the next call takes it (``cache`` since transformers 5)."""
    cache = getattr(output, "cache", None)
    return {"cache": cache} if cache is not None else {"past_key_values": output.past_key_values}


def _finite(value: Any) -> float:
    """A log-probability as a float (vLLM sends ``None`` for one it could not compute: NaN, as TRL reads it)."""
    return math.nan if value is None else float(value)
